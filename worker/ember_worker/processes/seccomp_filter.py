"""The seccomp filter every sandboxed replica runs under, built with libseccomp.

A deny list at least as strict as Docker's default profile's (the calls it refuses to a
container without added capabilities), applied by the PID namespace's init just before
the exec of the replica's interpreter, after no_new_privs: nothing the app brings runs
without it, and every child inherits it. CRIU dumps the filter with the process and
restores it (its own code in the replica runs with the filter suspended).

Refused with EPERM: ptrace and reading or writing other processes' memory, mounting
(old and new mount APIs), pivot_root, unshare and setns, clone with a namespace flag,
kexec, module loading, bpf, perf events, keyctl and the key calls, userfaultfd,
io_uring, the clock and time setters, swap, reboot, quotas, accounting, handles to
files by number (open_by_handle_at), the NUMA policy calls, syslog, and the 32-bit and
x32 system call tables (another architecture's call kills the process, libseccomp's default).
clone3 answers ENOSYS, as in Docker's profile: its flags are in memory a filter cannot
read, and glibc falls back to clone, whose flags the filter checks.

libseccomp is reached with ctypes (the init script runs with the standard library
only); Debian's libseccomp2, which most of the system already links against.
"""

from __future__ import annotations

import ctypes
import errno

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7
SCMP_FLTATR_CTL_NNP = 3  # libseccomp sets no_new_privs itself unless told not to


def scmp_act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


DENIED = (
    # other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
    # the kernel itself
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "query_module",
    "get_kernel_syms",
    "bpf",
    "perf_event_open",
    "fanotify_init",
    "lookup_dcookie",
    "quotactl",
    "quotactl_fd",
    "nfsservctl",
    "sysfs",
    "_sysctl",
    "syslog",
    "uselib",
    "ustat",
    "vm86",
    "vm86old",
    "iopl",
    "ioperm",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "vhangup",
    # keys
    "keyctl",
    "add_key",
    "request_key",
    # time
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "stime",
    # memory of others, fault handling, asynchronous I/O rings
    "userfaultfd",
    "move_pages",
    "mbind",
    "set_mempolicy",
    "migrate_pages",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # host names (the UTS namespace is the replica's; its name is fixed)
    "sethostname",
    "setdomainname",
)
NAMESPACE_FLAGS = (  # clone's flags that make a namespace (CLONE_NEWTIME is CSIGNAL's bit)
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _library() -> ctypes.CDLL:
    try:  # by its soname first: find_library runs ldconfig, tens of milliseconds
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        from ctypes.util import find_library

        lib = ctypes.CDLL(find_library("seccomp") or "libseccomp.so", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    return lib


_LOADED: list[ctypes.CDLL] = []


def load_library() -> ctypes.CDLL:
    """libseccomp, loaded once in this process: before a sandbox's root (an image's)
    hides the node's copy."""
    if not _LOADED:
        _LOADED.append(_library())
    return _LOADED[0]


def available() -> str | None:
    """None if libseccomp can be loaded here, else why not."""
    try:
        _library()
    except OSError as exc:
        return f"libseccomp cannot be loaded: {exc}"
    return None


def install() -> None:
    """Put this process (and everything it execs or starts) under the filter (OSError
    naming the step that failed). no_new_privs must already be set, or CAP_SYS_ADMIN held."""
    lib = load_library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0), "seccomp_attr_set")
        eperm = scmp_act_errno(errno.EPERM)
        for name in DENIED:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a call of this architecture (vm86 on x86_64, ...)
                continue
            _check(lib.seccomp_rule_add_array(ctx, eperm, number, 0, None), name)
        clone = lib.seccomp_syscall_resolve_name(b"clone")
        for flag in NAMESPACE_FLAGS:
            cmp = (_ArgCmp * 1)(_ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
            _check(lib.seccomp_rule_add_array(ctx, eperm, clone, 1, cmp), "clone")
        clone3 = lib.seccomp_syscall_resolve_name(b"clone3")
        if clone3 >= 0:
            enosys = scmp_act_errno(errno.ENOSYS)
            _check(lib.seccomp_rule_add_array(ctx, enosys, clone3, 0, None), "clone3")
        _check(lib.seccomp_load(ctx), "seccomp_load")
    finally:
        lib.seccomp_release(ctx)


def _check(result: int, what: str) -> None:
    if result != 0:  # libseccomp returns -errno
        raise OSError(-result, f"seccomp {what}: {errno.errorcode.get(-result, result)}")
