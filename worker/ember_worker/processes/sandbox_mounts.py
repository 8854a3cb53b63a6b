"""A replica's sandbox plan: its root folder of mount points and the bind mounts in it.

The agent (agent/replicas/sandboxes.py) decides what a replica sees and writes the plan
for the PID namespace's init, which enters it (mount_namespace.py); it makes the root
folder (`make_root`) and a tmpfs of the replica's own for /tmp and /dev/shm
(`mount_scratch`). Every mount is a bind mount of the node's, which CRIU dumps as an
external mount named by its `key` (the path inside) and mounts again at a restore from
the restoring replica's own plan: a restored replica lands in a namespace like the one
it was dumped in, with its own working area and scratch.
"""

from __future__ import annotations

import marshal
import os
from dataclasses import dataclass, field
from pathlib import Path

from ember_worker.processes import mount_namespace

# The device nodes every replica gets (the node's, bind-mounted one by one).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
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
    device: bool = False  # a device node: mounted without nodev


@dataclass
class SandboxPlan:
    root: str  # the host folder that becomes "/": empty mount points, root's
    mounts: list[Mount] = field(default_factory=list)
    scratch: str = ""  # the host folder of its tmpfs (tmp/ and shm/: /tmp and /dev/shm)
    worker_dir: str = ""  # the worker's folder on the node, WORKER_INSIDE inside
    cwd: str = "/"  # where the replica starts (its bundle, inside)
    # An image's root on the node, when the replica runs on one: its top-level entries
    # are mounts, its top-level links `links` (name: target), made in the root folder.
    image_root: str = ""
    links: dict[str, str] = field(default_factory=dict)
    # Folders inside that hold only mount points yet must be listed: a PYTHONPATH entry
    # (Python's importer lists each, and finds nothing in one it may not read).
    listable: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        """What the init script reads (mount_namespace.read_plan): marshal, which it
        reads without importing anything."""
        mounts = [(m.source, m.target, m.writable, m.device, m.key) for m in self.mounts]
        plain = {
            "root": self.root,
            "cwd": self.cwd,
            "scratch": self.scratch,
            "worker_dir": self.worker_dir,
            "mounts": mounts,
            "image_root": self.image_root,
            "links": self.links,
            "listable": self.listable,
        }
        return marshal.dumps(plain)

    @classmethod
    def from_bytes(cls, data: bytes) -> SandboxPlan:
        plain = marshal.loads(data)
        mounts = [Mount(s, t, k, w, d) for s, t, w, d, k in plain.pop("mounts")]
        return cls(mounts=mounts, **plain)

    def inside(self, host: str | Path) -> str:
        """The path inside of a path on the node (the same, outside the worker's folder)."""
        path = Path(host)
        if self.worker_dir and path.is_relative_to(self.worker_dir):
            return str(Path(WORKER_INSIDE) / path.relative_to(self.worker_dir))
        return str(path)

    def on_node(self, inside: str) -> str:
        """The node's path of a path inside under the worker's folder or in an image's
        root (else the same)."""
        path = Path(inside)
        if self.image_root and len(path.parts) > 1:
            top = "/" + path.parts[1]
            if any(m.target == top and m.source.startswith(self.image_root) for m in self.mounts):
                return self.image_root + inside
        if self.worker_dir and path.is_relative_to(WORKER_INSIDE):
            return str(Path(self.worker_dir) / path.relative_to(WORKER_INSIDE))
        return inside


def _mount_point(root: str, mount: Mount, under: str = "") -> None:
    """The mount point of `mount` in `root` (its path inside made relative to `under`),
    and the folders above it: those can be passed through, not listed (they hold only
    mount points, but say nothing)."""
    point = Path(root + mount.target[len(under) :])
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
    file for a file or device node), /proc, the /dev links, and the merged-/usr links
    (the agent, as root; blocking). Mount points under /tmp go into the scratch
    folder's tmp/, which is mounted there."""
    root = Path(plan.root)
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    for name in ("proc", "dev", "tmp"):
        (root / name).mkdir(mode=0o755, exist_ok=True)
    links = (
        plan.links
        if plan.image_root
        else {name: target for name, target in SYSTEM_LINKS.items() if os.path.islink(f"/{name}")}
    )
    for name, target in links.items():
        if not (root / name).is_symlink():
            (root / name).symlink_to(target)
    for name, target in DEV_LINKS.items():
        if not (root / "dev" / name).is_symlink():
            (root / "dev" / name).symlink_to(target)
    for mount in plan.mounts:
        if mount.target.startswith("/tmp/") and plan.scratch:
            _mount_point(f"{plan.scratch}/tmp", mount, "/tmp")
        else:
            _mount_point(plan.root, mount)
    for inside in plan.listable:
        folder = root / inside.lstrip("/")
        if folder.is_dir():
            os.chmod(folder, 0o755)


def device_mounts(extra: list[str]) -> list[tuple[str, str]]:
    """(host node, path inside) of the device nodes a replica gets: the usual ones and
    `extra` (its GPUs')."""
    return [(f"/dev/{name}", f"/dev/{name}") for name in DEVICES] + [
        (host, f"/dev/{os.path.basename(host)}") for host in extra
    ]


def mount_scratch(path: Path, size: int) -> None:
    """A tmpfs of `size` bytes at `path` (on the node, by the agent), with tmp/ and shm/
    open to all (sticky), for a replica's /tmp and /dev/shm."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mount_namespace.mount_tmpfs(str(path), size)
    for name in ("tmp", "shm"):
        (path / name).mkdir()
        os.chmod(path / name, 0o1777)


def unmount(path: Path) -> None:
    """Detach what is mounted at `path` (nothing if nothing is)."""
    mount_namespace.unmount(str(path))
