"""A replica's own mount, IPC and UTS namespaces, entered from the plan the agent wrote.

The PID namespace's init (pid_namespace_init.py) calls `enter(read_plan(path))` in the
replica's process, as root, before it gives up root: new mount, IPC and UTS
namespaces; every mount made private; the plan's root folder (empty mount points, made
by the agent: sandbox_mounts.make_root) bind-mounted onto itself; the plan's bind
mounts inside it, read-only unless writable, nosuid, nodev but for device nodes; then
`pivot_root` into it, the node's root detached, a fresh /proc of its PID namespace (its
kernel settings read-only), the root read-only, and the replica's host name.

Only os, marshal and ctypes: it runs in the init script of every replica, whose start
it should not slow (json and dataclasses alone take tens of milliseconds to import).
"""

from __future__ import annotations

import ctypes
import marshal
import os

TYPE_CHECKING = False  # typing itself costs milliseconds to import, at every start
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86_64; aarch64's is 41 (_pivot_root_number)
HOSTNAME = "replica"
PROC_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
# What of /proc writes to the kernel rather than to the replica's own processes.
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    return libc


def _call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(
    libc: ctypes.CDLL,
    source: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    _call(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def _bind(libc: ctypes.CDLL, source: str, target: str, writable: bool, device: bool) -> None:
    _mount(libc, source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV)
    _mount(libc, None, target, None, flags if writable else flags | MS_RDONLY)


def _pivot_root_number() -> int:
    return 41 if os.uname().machine == "aarch64" else SYS_PIVOT_ROOT


def read_plan(path: str) -> dict[str, Any]:
    """The plan the agent wrote (sandbox_mounts.SandboxPlan.to_bytes)."""
    with open(path, "rb") as plan:
        loaded: dict[str, Any] = marshal.load(plan)
    return loaded


def mount_tmpfs(path: str, size: int) -> None:
    """A tmpfs of `size` bytes at `path`, root's alone at its top."""
    _mount(_libc(), "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=700,size={size}")


def unmount(path: str) -> None:
    """Detach what is mounted at `path` (nothing if nothing is)."""
    _libc().umount2(path.encode(), MNT_DETACH)


def enter(plan: dict[str, Any]) -> None:
    """Move this process (PID 1 of its PID namespace, root) into its own mount, IPC and
    UTS namespaces and into the plan's root (OSError on any step that failed)."""
    libc = _libc()
    _call(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    # Nothing mounted here reaches the node's namespace, nor the other way round.
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    root = plan["root"]
    _mount(libc, root, root, None, MS_BIND)  # pivot_root needs a mount point
    # Every mount a bind mount of the node's (CRIU's external mounts: no content of
    # theirs in an image, nothing to unpack at a restore), parents before children.
    for source, target, writable, device, _ in sorted(
        plan["mounts"], key=lambda m: m[1].count("/")
    ):
        _bind(libc, source, root + target, writable, device)
    hostname = HOSTNAME.encode()
    _call(libc.sethostname(hostname, len(hostname)), "sethostname")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up on top of the new one, then detached.
    _call(libc.syscall(_pivot_root_number(), b".", b"."), "pivot_root")
    _call(libc.umount2(b".", MNT_DETACH), "detaching the node's root")
    os.chdir("/")
    _mount(libc, "proc", "/proc", "proc", PROC_FLAGS)
    # The kernel's settings read-only (as Docker's default does): a process of uid 0,
    # even without a single capability (a replica's snapshot phase where CRIU must
    # restore it as root), may otherwise write every sysctl of mode 0644, core_pattern
    # among them: a crash would then run a command of its choice as the node's root.
    for name in PROC_READ_ONLY:
        path = "/proc/" + name
        if os.path.exists(path):
            _mount(libc, path, path, None, MS_BIND)
            _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | PROC_FLAGS)
    _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(plan["cwd"])
