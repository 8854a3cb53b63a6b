"""A replica's own mount, IPC and UTS namespaces, built from a plan the agent writes.

The PID namespace's init (pid_namespace_init.py) calls `enter(plan)` in the replica's
process, as root, before it gives up root: new mount, IPC and UTS namespaces; every
mount made private; a root folder of empty mount points (made by the agent, root's,
read-only once built) bind-mounted onto itself; the plan's mounts inside it; then
`pivot_root` into it, the old root detached, a fresh /proc of its PID namespace, a small
/dev of its own. The system and the Python environments are read-only bind mounts at
their own paths (so that a snapshot's image names the same files inside and out); the
working area, /tmp (a size-limited tmpfs) and the app's volume copies are the only
writable places.

Standard library only, ctypes for the system calls: it runs in the init script, before
any package of the app's environment may run. Every mount a plan names is CRIU's to
dump as an external bind mount (`external_keys`), and to put back at restore from the
restoring replica's own plan: a restored replica lands in a namespace like the one it
was dumped in, with its own working area.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
# The device nodes every replica gets (character devices: major, minor), made in a tmpfs.
DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}
# Merged /usr: these are links at the root, made in the root folder, not mounts.
SYSTEM_LINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
SYSTEM_DIRS = ("/usr", "/etc")
SANDBOX_HOME = "/home/replica"  # the working area's path inside, the same at every restore
# Where the worker's folder (bundles, environments, volumes, weights) is inside, whatever
# its path on the node: an image taken on one node names the same files on every other.
WORKER_INSIDE = "/ember/worker"


@dataclass(frozen=True)
class Mount:
    """`source` (a host path) bind-mounted at `target` inside; `key` names it in CRIU's
    images, so that a restore can mount this replica's own `source` there."""

    source: str
    target: str
    key: str
    writable: bool = False


@dataclass
class SandboxPlan:
    root: str  # the host folder that becomes "/": empty mount points, root's
    mounts: list[Mount] = field(default_factory=list)
    tmp_bytes: int = 256 * 1024 * 1024  # /tmp's size
    devices: list[str] = field(default_factory=list)  # extra device nodes (GPUs), host paths
    worker_dir: str = ""  # the worker's folder on the node, WORKER_INSIDE inside
    cwd: str = "/"  # where the replica starts (its bundle, inside)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SandboxPlan:
        data = json.loads(text)
        mounts = [Mount(**m) for m in data.pop("mounts")]
        return cls(mounts=mounts, **data)

    def inside(self, host: str | Path) -> str:
        """The path inside of a path on the node (the same, outside the worker's folder)."""
        path = Path(host)
        if self.worker_dir and path.is_relative_to(self.worker_dir):
            return str(Path(WORKER_INSIDE) / path.relative_to(self.worker_dir))
        return str(path)

    def on_node(self, inside: str) -> str:
        """The node's path of a path inside under the worker's folder (else the same)."""
        path = Path(inside)
        if self.worker_dir and path.is_relative_to(WORKER_INSIDE):
            return str(Path(self.worker_dir) / path.relative_to(WORKER_INSIDE))
        return inside


def _mount_point(root: str, mount: Mount) -> None:
    """The mount point of `mount` in `root`, and the folders above it: those can be
    passed through, not listed (they hold only mount points, but say nothing)."""
    point = Path(root + mount.target)
    missing = [p for p in point.parents if p.is_relative_to(root) and not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o711)
        os.chmod(folder, 0o711)  # whatever the umask
    if os.path.isdir(mount.source):
        point.mkdir(mode=0o755, exist_ok=True)
    elif not point.exists():
        point.touch(mode=0o644)


def make_root(plan: SandboxPlan) -> None:
    """Build the plan's root folder: a mount point for each mount (a folder, or an empty
    file for a file), /proc, /dev and /tmp, and the merged-/usr links (the agent, as
    root; blocking)."""
    root = Path(plan.root)
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    for name in ("proc", "dev", "tmp"):
        (root / name).mkdir(mode=0o755, exist_ok=True)
    for name, target in SYSTEM_LINKS.items():
        if os.path.islink(f"/{name}") and not (root / name).is_symlink():
            (root / name).symlink_to(target)
    for mount in plan.mounts:
        _mount_point(plan.root, mount)


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


def _bind(libc: ctypes.CDLL, source: str, target: str, writable: bool) -> None:
    _mount(libc, source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV
    _mount(libc, None, target, None, flags if writable else flags | MS_RDONLY)


def _pivot_root_number() -> int:
    return 41 if os.uname().machine == "aarch64" else SYS_PIVOT_ROOT


def _make_dev(libc: ctypes.CDLL, dev: str, extra: list[str]) -> None:
    """A tmpfs /dev holding the usual character devices, the plan's extra ones (the
    GPUs' nodes, same numbers as the host's), /dev/shm and the /proc links."""
    _mount(libc, "tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755,size=64k")
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"{dev}/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(f"{dev}/{name}", 0o666)
    for host in extra:
        info = os.stat(host)
        os.mknod(f"{dev}/{os.path.basename(host)}", 0o666 | stat.S_IFCHR, info.st_rdev)
        os.chmod(f"{dev}/{os.path.basename(host)}", 0o666)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm", 0o1777)
    _mount(libc, "tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")


def enter(plan: SandboxPlan) -> None:
    """Move this process (PID 1 of its PID namespace, root) into its own mount, IPC and
    UTS namespaces and into the plan's root (OSError on any step that failed)."""
    libc = _libc()
    _call(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    # Nothing mounted here reaches the node's namespace, nor the other way round.
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    root = plan.root
    _mount(libc, root, root, None, MS_BIND)  # pivot_root needs a mount point
    tmp_options = f"mode=1777,size={plan.tmp_bytes}"
    _mount(libc, "tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options)
    for mount in sorted(plan.mounts, key=lambda m: m.target.count("/")):
        if mount.target.startswith("/tmp/"):  # the node's /tmp (a test's state dir)
            _mount_point(root, mount)  # in the new tmpfs, which hides the root folder's
        _bind(libc, mount.source, root + mount.target, mount.writable)
    _make_dev(libc, f"{root}/dev", plan.devices)
    hostname = HOSTNAME.encode()
    _call(libc.sethostname(hostname, len(hostname)), "sethostname")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up on top of the new one, then detached.
    _call(libc.syscall(_pivot_root_number(), b".", b"."), "pivot_root")
    _call(libc.umount2(b".", MNT_DETACH), "detaching the node's root")
    os.chdir("/")
    _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
