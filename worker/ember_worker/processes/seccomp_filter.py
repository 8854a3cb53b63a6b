"""The seccomp filter every sandboxed replica runs under, built with libseccomp.

An allowlist that follows Docker's default seccomp profile for a container without added
capabilities: the calls in the groups below are allowed, `personality`, `socket` and
`clone` only with the arguments Docker allows, and every other call answers EPERM,
including each call a future kernel adds until it is listed here. Applied by the PID
namespace's init just before the exec of the replica's interpreter, after no_new_privs
(and by `ember replica exec` before its command's, and to image build steps): nothing the
app brings runs without it, and every child inherits it. CRIU dumps the filter with the
process and restores it (its own code in the replica runs with the filter suspended).

Refused as Docker refuses them without the capability: everything of CAP_SYS_ADMIN
(mount and the new mount API, unshare, setns, clone with a namespace flag, bpf,
perf_event_open, quotas, sethostname), the key calls, userfaultfd, io_uring, module
loading, kexec, reboot, swap, acct, the clock setters, kcmp, pidfd_getfd,
process_madvise, the NUMA policy calls (libnuma then reports no NUMA), syslog.
`personality` takes the Linux, 32-bit and UNAME26 personalities and the query (also as
-1, as C code asks), `socket` no AF_ALG and no AF_VSOCK. clone3 answers ENOSYS, as in
Docker's profile: its flags are in memory a filter cannot read, and glibc falls back to
clone, whose flags the filter checks.

A replica whose snapshot phase runs as uid 0 (pid_namespace_init.py's
--root-until-snapshot) keeps CAP_SETUID and CAP_SETGID to become its user at its quiet
point; its filter (install's `ids`) lets the calls that change ids name only root's ids,
its user's or -1 (unchanged), and setgroups only no groups: it becomes no other uid of
the node's (another workspace's replicas', its network's owner, the build steps').

Stricter than Docker's profile where nothing a model endpoint runs (CPython, torch,
vLLM, the CUDA user-space libraries) needs it:
- ptrace and `process_vm_readv/writev` (Docker allows them on kernels from 4.8): no
  process in a sandbox reads another's memory (`ember profile` reads from outside);
- `name_to_handle_at`, `adjtimex`, `clock_adjtime` (refused here before the allowlist);
- socket families are named one by one past AF_VSOCK (to AF_MCTP, 45), where Docker
  allows "greater than 40": compared as 64 bits, that also matches AF_VSOCK with bits set
  above the 32 the kernel reads;
- the filter is of the node's own 64-bit table (a call of another table kills the
  process, libseccomp's default): no 32-bit calls; nor `modify_ldt`, `set_thread_area`,
  `fanotify_mark` (without `fanotify_init`, which is refused) or the legacy epoll calls.

A name this libseccomp does not know (a call newer than it) is left out: that call
answers EPERM on this node until libseccomp knows it.

libseccomp is reached with ctypes (the init script runs with the standard library
only); Debian's libseccomp2, which most of the system already links against.
"""

from __future__ import annotations

import ctypes
import errno
import itertools

SCMP_CMP_LT = 2
SCMP_CMP_EQ = 4
SCMP_CMP_MASKED_EQ = 7
SCMP_FLTATR_CTL_NNP = 3  # libseccomp sets no_new_privs itself unless told not to
SCMP_FLTATR_CTL_OPTIMIZE = 8  # 2: a binary tree of the calls, not a list (libseccomp 2.5)


def scmp_act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_EPERM = scmp_act_errno(errno.EPERM)

# Files and folders: CPython's os and io, the dynamic loader, every cache and model file.
FILES = (
    "read", "write", "readv", "writev", "pread64", "pwrite64",
    "preadv", "pwritev", "preadv2", "pwritev2",
    "open", "openat", "openat2", "creat", "close", "close_range",
    "lseek", "dup", "dup2", "dup3", "fcntl", "flock", "ioctl",
    "fsync", "fdatasync", "sync", "syncfs", "sync_file_range",
    "fadvise64", "readahead", "cachestat", "fallocate", "ftruncate", "truncate",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs",
    "access", "faccessat", "faccessat2",
    "getcwd", "chdir", "fchdir", "getdents", "getdents64",
    "mkdir", "mkdirat", "rmdir", "rename", "renameat", "renameat2",
    "link", "linkat", "unlink", "unlinkat", "symlink", "symlinkat",
    "readlink", "readlinkat", "umask",
    "chmod", "fchmod", "fchmodat", "fchmodat2",
    "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "utimensat", "futimesat",
    "mknod", "mknodat",  # FIFOs: a device node wants CAP_MKNOD, which no replica holds
    "sendfile", "copy_file_range", "splice", "tee", "vmsplice",
    "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
    "statmount", "listmount",  # read what its own mount namespace shows
)  # fmt: skip
# Extended attributes (pip's and the loaders' capabilities and ACL checks).
XATTRS = (
    "getxattr", "lgetxattr", "fgetxattr", "getxattrat",
    "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
    "listxattr", "llistxattr", "flistxattr", "listxattrat",
    "removexattr", "lremovexattr", "fremovexattr", "removexattrat",
)  # fmt: skip
# Memory: the allocators, the loader's mappings, torch's and CUDA's pools and pinned
# host memory (mlock), memory files for shared tensors and JIT code.
MEMORY = (
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "msync",
    "mlock", "mlock2", "munlock", "mlockall", "munlockall", "remap_file_pages",
    "membarrier", "memfd_create", "memfd_secret", "mseal", "map_shadow_stack",
    "pkey_alloc", "pkey_free", "pkey_mprotect",
)  # fmt: skip
# Processes and threads of its own tree: fork and exec (clone and clone3 are below),
# waiting, signals, the futexes of every lock, glibc's thread set-up (rseq, robust
# lists), pidfds (subprocess).
PROCESSES = (
    "fork", "vfork", "execve", "execveat", "exit", "exit_group",
    "wait4", "waitid", "kill", "tkill", "tgkill",
    "pidfd_open", "pidfd_send_signal", "process_mrelease",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending",
    "rt_sigtimedwait", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "rt_sigsuspend",
    "sigaltstack", "signalfd", "signalfd4", "pause", "restart_syscall",
    "futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue",
    "set_tid_address", "set_robust_list", "get_robust_list", "rseq",
    "arch_prctl",  # x86_64: a thread's TLS register
    "prctl",  # thread names, no_new_privs, PR_SET_PDEATHSIG (vLLM's workers)
    "getpid", "getppid", "gettid", "getpgid", "setpgid", "getpgrp", "getsid", "setsid",
)  # fmt: skip
# Its ids, limits and the machine it runs on (the calls that change its ids are below).
IDENTITY = (
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "capget", "capset",
    "getrlimit", "setrlimit", "prlimit64", "getrusage", "times",
    "getpriority", "setpriority", "uname", "sysinfo", "getcpu", "getrandom",
)  # fmt: skip
# Scheduling: OpenMP's, torch's and vLLM's threads pinned to CPUs and prioritised.
SCHEDULING = (
    "sched_yield", "sched_getaffinity", "sched_setaffinity",
    "sched_getparam", "sched_setparam", "sched_getscheduler", "sched_setscheduler",
    "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
    "sched_getattr", "sched_setattr", "ioprio_get", "ioprio_set",
)  # fmt: skip
# Clocks, sleeps and timers (where the vDSO does not answer).
TIME = (
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday",
    "time", "alarm", "getitimer", "setitimer",
    "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun", "timer_delete",
    "timerfd_create", "timerfd_settime", "timerfd_gettime",
)  # fmt: skip
# Waiting on descriptors: asyncio's and uvicorn's event loops, pipes to children.
EVENTS = (
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait",
    "epoll_pwait2", "poll", "ppoll", "select", "pselect6",
    "eventfd", "eventfd2", "pipe", "pipe2",
)  # fmt: skip
# Sockets once made (`socket` itself is below, by family): HTTP, the calls' server,
# vLLM's and torch.distributed's local sockets.
NETWORK = (
    "socketpair", "bind", "listen", "accept", "accept4", "connect", "shutdown",
    "getsockname", "getpeername", "getsockopt", "setsockopt",
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg",
)  # fmt: skip
# System V and POSIX IPC, in the replica's own IPC namespace: shared memory of
# multiprocessing and torch's DataLoader, semaphores, message queues.
IPC = (
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
    "mq_getsetattr",
)  # fmt: skip
# Linux asynchronous I/O (not io_uring): readers of large files (safetensors, DeepSpeed).
AIO = ("io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents")
# Sandboxes of the process's own, which only narrow what it may do.
SELF_SANDBOX = (
    "seccomp", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
)  # fmt: skip
# The kernel's uretprobe trampoline (x86_64), where the node traces a replica.
TRACED = ("uretprobe",)

ALLOWED = (
    *FILES, *XATTRS, *MEMORY, *PROCESSES, *IDENTITY, *SCHEDULING, *TIME, *EVENTS,
    *NETWORK, *IPC, *AIO, *SELF_SANDBOX, *TRACED,
)  # fmt: skip

# Allowed with these arguments only (Docker's values):
PERSONALITIES = (  # personality(2): Linux, 32-bit, UNAME26 and both, and the query
    0x0000000,  # PER_LINUX
    0x0000008,  # PER_LINUX32
    0x0020000,  # UNAME26
    0x0020008,  # UNAME26 | PER_LINUX32
    0xFFFFFFFF,  # asks for the current one
    0xFFFFFFFFFFFFFFFF,  # the same asked as -1 (glibc passes an unsigned long on)
)
# socket(2)'s families: every one below AF_ALG (38), AF_NFC (39), and those after
# AF_VSOCK (40) up to AF_MCTP (45, the last of Linux 6.x). Compared as 64-bit values and
# named one by one above 40, so a family with bits set above the 32 the kernel reads
# (it reads an int: 1 << 32 | 40 is AF_VSOCK) matches nothing.
SOCKET_FAMILIES_BELOW = 38
SOCKET_FAMILIES = (39, 41, 42, 43, 44, 45)
# The calls that change its ids, and how many ids each takes. Without a capability a
# process may only move between ids it already holds: allowed as they are. With `ids`
# (install's: a snapshot phase's uid 0, which holds CAP_SETUID and CAP_SETGID to become
# its user), each id only 0 (stay root), its user's or -1 (unchanged) where the call
# takes that (setuid and setgid do not: -1 is EINVAL there), and setgroups only with no
# groups: the kernel reads a uid_t of 32 bits, so the low 32 bits of each argument are
# compared (the same call made with -1 as 64 bits, or with bits above, is the same ask).
SET_IDS = {
    "setuid": 1, "setgid": 1, "setfsuid": 1, "setfsgid": 1,
    "setreuid": 2, "setregid": 2, "setresuid": 3, "setresgid": 3,
}  # fmt: skip
TAKE_NO_UNCHANGED = ("setuid", "setgid")
ID_BITS = 0xFFFFFFFF  # a uid_t's, and -1 as one
NAMESPACE_FLAGS = (  # clone's flags that make a namespace (CLONE_NEWTIME is CSIGNAL's bit)
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

# Refused by the default action: listed so that a test can check that no group above
# ever lets one in (and the docs name them).
REFUSED = (
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_getfd",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "name_to_handle_at", "open_by_handle_at",
    # the kernel itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "fanotify_init", "lookup_dcookie", "quotactl",
    "quotactl_fd", "nfsservctl", "sysfs", "_sysctl", "syslog", "uselib", "ustat",
    "iopl", "ioperm", "reboot", "swapon", "swapoff", "acct", "vhangup", "modify_ldt",
    # keys
    "keyctl", "add_key", "request_key",
    # time
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    # memory of others and NUMA policy, fault handling, asynchronous I/O rings
    "userfaultfd", "move_pages", "mbind", "set_mempolicy", "get_mempolicy",
    "migrate_pages", "set_mempolicy_home_node",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # host names (the UTS namespace is the replica's; its name is fixed)
    "sethostname", "setdomainname",
    # the security modules' attributes
    "lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules",
)  # fmt: skip


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
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
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


def resolve(lib: ctypes.CDLL, name: str) -> int | None:
    """The call's number on this architecture; None where libseccomp does not know the
    name (a call newer than it: -1) or the call is not of this architecture (a negative
    pseudo number, as `chown32` on x86_64)."""
    number = int(lib.seccomp_syscall_resolve_name(name.encode()))
    return number if number >= 0 else None


def install(ids: tuple[int, int] | None = None) -> None:
    """Put this process (and everything it execs or starts) under the filter (OSError
    naming the step that failed). no_new_privs must already be set, or CAP_SYS_ADMIN held.
    With `ids` (uid, gid), the calls that change ids take root's, those or none (SET_IDS)."""
    lib = load_library()
    ctx = lib.seccomp_init(SCMP_ACT_EPERM)  # what no rule allows
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0), "seccomp_attr_set")
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)  # only faster: may fail
        for name in ALLOWED:
            _allow(lib, ctx, name)
        for persona in PERSONALITIES:
            _allow(lib, ctx, "personality", _ArgCmp(0, SCMP_CMP_EQ, persona, 0))
        _allow(lib, ctx, "socket", _ArgCmp(0, SCMP_CMP_LT, SOCKET_FAMILIES_BELOW, 0))
        for family in SOCKET_FAMILIES:
            _allow(lib, ctx, "socket", _ArgCmp(0, SCMP_CMP_EQ, family, 0))
        _allow_set_ids(lib, ctx, ids)
        mask = sum(NAMESPACE_FLAGS)  # clone with none of them set
        _allow(lib, ctx, "clone", _ArgCmp(0, SCMP_CMP_MASKED_EQ, mask, 0))
        clone3 = resolve(lib, "clone3")
        if clone3 is not None:
            enosys = scmp_act_errno(errno.ENOSYS)
            _check(lib.seccomp_rule_add_array(ctx, enosys, clone3, 0, None), "clone3")
        _check(lib.seccomp_load(ctx), "seccomp_load")
    finally:
        lib.seccomp_release(ctx)


def _allow_set_ids(lib: ctypes.CDLL, ctx: int, ids: tuple[int, int] | None) -> None:
    if ids is None:
        for name in (*SET_IDS, "setgroups"):
            _allow(lib, ctx, name)
        return
    uid, gid = ids
    for name, count in SET_IDS.items():
        own = uid if "uid" in name else gid
        values = dict.fromkeys((0, own & ID_BITS))  # once each: own may be 0
        if name not in TAKE_NO_UNCHANGED:
            values[ID_BITS] = None
        # One rule for each combination of the allowed values (27 for setresuid).
        for chosen in itertools.product(values, repeat=count):
            _allow(
                lib,
                ctx,
                name,
                *(_ArgCmp(arg, SCMP_CMP_MASKED_EQ, ID_BITS, v) for arg, v in enumerate(chosen)),
            )
    # setgroups(0, ...) only: no supplementary groups (the list is in memory, unread here).
    _allow(lib, ctx, "setgroups", _ArgCmp(0, SCMP_CMP_MASKED_EQ, ID_BITS, 0))


def _allow(lib: ctypes.CDLL, ctx: int, name: str, *args: _ArgCmp) -> None:
    number = resolve(lib, name)
    if number is None:
        return
    compare = (_ArgCmp * len(args))(*args) if args else None
    added = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, number, len(args), compare)
    _check(added, name)


def _check(result: int, what: str) -> None:
    if result != 0:  # libseccomp returns -errno
        raise OSError(-result, f"seccomp {what}: {errno.errorcode.get(-result, result)}")
