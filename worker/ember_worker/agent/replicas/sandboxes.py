"""Each replica's sandbox plan: what its mount namespace shows, and where (sandbox_mounts.py).

Read-only: the system (/usr and the few files of /etc a Python program reads: never the
rest of /etc), the interpreter, the standard library, Ember's packages, the app's Python
environment and its bundle, and the folders the operator shows every replica
(`--model-dir`). Writable: its working area (at /home/replica inside,
whichever replica's it is: a restore mounts its own there), its app's volume copies, the
weights cache of its workspace (which its replicas fill: see docs/security.md), a
size-limited /tmp. Device nodes (null, zero, full, random, urandom, tty, its GPUs'): a
read-only bind mount each, which still reads and writes the device but changes no mode
or owner of the node's. Nothing else of the node: no state dir, no worker folders, no other
app's bundle, volumes or logs.

What lies in the worker's folder is mounted under /ember/worker inside (WORKER_INSIDE),
whatever the folder's path on the node: an image taken on one node names the same paths
on another. Everything else keeps its own path. The plan and the root folder of mount
points live in `<work dir>/sandboxes/<replica id>/` (root's alone), removed when the
replica ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from ember_worker.agent.config import AgentConfig
from ember_worker.agent.replicas.image_replicas import (
    CA_INSIDE,
    ETC_FROM_NODE,
    PACKAGES_INSIDE,
    ImageRun,
)
from ember_worker.processes.sandbox_mounts import (
    SANDBOX_HOME,
    SYSTEM_DIRS,
    Mount,
    SandboxPlan,
    device_mounts,
    make_root,
    mount_scratch,
    unmount,
)

SANDBOXES_DIR = "sandboxes"
# What of /etc a replica sees: the loader's cache, names and addresses, time zones,
# certificates. Not shadow files, keys, or the host's own configuration.
ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "resolv.conf",
    "hosts",
    "host.conf",
    "nsswitch.conf",
    "gai.conf",
    "passwd",
    "group",
    "protocols",
    "services",
    "mime.types",
    "os-release",
    "ssl/certs",
    "ca-certificates",
    "ca-certificates.conf",
    "ssl/openssl.cnf",
    "pki",
)
# Host paths replicas may also write (colon-separated), for test runs whose replicas
# write coverage data; empty in production.
WRITABLE_ENV = "EMBER_SANDBOX_WRITABLE"
TMP_BYTES = 256 * 1024 * 1024
# Where a sandboxed replica finds the control plane's channel socket (a node-local one).
CHANNEL_INSIDE = "/ember/channel.sock"
NO_CHANNEL = "no-channel"  # mounted there on a node without a control plane of its own
SYS_VIEWS = [(Path("/sys/devices/system/cpu"), "/sys/devices/system/cpu")]  # topology
# Listed as on any machine (programs tell cgroup v1 from v2 by what /sys/fs/cgroup holds).
SYS_LISTED = ("/sys", "/sys/fs", "/sys/fs/cgroup", "/sys/devices", "/sys/devices/system")


def mount_key(target: str) -> str:
    """A mount's name in CRIU's images: from its path inside, so that a restore's plan
    names the same mounts whatever the replica."""
    return "m" + hashlib.sha256(target.encode()).hexdigest()[:16]


def _mount(source: Path | str, target: str, writable: bool = False) -> Mount:
    return Mount(os.path.realpath(source), target, key=mount_key(target), writable=writable)


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """The paths not inside another of them (mounting that one shows them)."""
    unique = sorted({Path(os.path.realpath(p)) for p in paths if os.path.exists(p)})
    kept: list[Path] = []
    for path in unique:
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


class ReplicaSandboxes:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.folder = config.work_dir / SANDBOXES_DIR

    def prepare_node(self) -> None:
        """Root's folder of plans; what an earlier run left goes (blocking)."""
        self.clean_node()
        self.folder.mkdir(mode=0o700, parents=True)
        _copy_etc(self.folder / "etc")
        (self.folder / NO_CHANNEL).touch(mode=0o644)

    def clean_node(self) -> None:
        """Remove every plan, its replicas' scratch tmpfs mounts first (at the worker's
        start and stop; blocking)."""
        for point in _mounts_under(self.folder):
            unmount(point)
        shutil.rmtree(self.folder, ignore_errors=True)

    def plan_path(self, replica_id: str) -> Path:
        return self.folder / replica_id / "plan.bin"

    def prepare(
        self,
        *,
        replica_id: str,
        app_key: str,
        bundle_dir: Path,
        runtime: Sequence[Path],
        home: Path,
        devices: Sequence[Path] = (),
        weights: Path | None = None,
        cgroups: Sequence[tuple[Path, str]] = (),
        image: ImageRun | None = None,
    ) -> SandboxPlan:
        """Write the replica's plan and its root folder (blocking); return the plan.
        `runtime`: the interpreter's, the environment's and Ember's folders. What is in
        the worker's folder is at WORKER_INSIDE inside (SandboxPlan.inside). `weights`:
        its workspace's weights cache (else the node's); `cgroups`: its own cgroups and
        where they go under /sys/fs/cgroup."""
        own = self.folder / replica_id
        plan = SandboxPlan(
            root=str(own / "root"),
            scratch=str(own / "scratch"),
            worker_dir=os.path.realpath(self.config.work_dir),
        )
        plan.cwd = plan.inside(os.path.realpath(bundle_dir))

        def _at_its_place(source: Path | str, writable: bool = False) -> Mount:
            return _mount(source, plan.inside(os.path.realpath(source)), writable)

        mounts = [_at_its_place(path) for path in SYSTEM_DIRS if path != "/etc"]
        mounts.append(_mount(self.folder / "etc", "/etc"))  # one mount: quicker restores
        code = _outermost([*runtime, bundle_dir])
        mounts += [_at_its_place(path) for path in code if not path.is_relative_to("/usr")]
        if self.config.ca_cert:
            mounts.append(_at_its_place(self.config.ca_cert))
        if image is not None:  # the image is its system: nothing of the node's above
            mounts = _image_mounts(plan, image, bundle_dir, self.folder / "etc", self.config)
        mounts.append(_at_its_place(weights or self.config.weights_dir, writable=True))
        mounts += [_at_its_place(folder) for folder in self.config.model_dirs]  # read-only
        volume = Path(self.config.volumes_dir) / app_key
        mounts.append(_at_its_place(volume, writable=True))
        # A /sys of its own limits and the CPUs (what torch and numpy read), nothing else.
        mounts += [_mount(host, inside) for host, inside in [*SYS_VIEWS, *cgroups]]
        mounts.append(_mount(home, SANDBOX_HOME, writable=True))
        # The control plane's socket where it is on this node, else an empty file: every
        # node's sandboxes have the same mounts, so an image restores on any of them.
        channel = self.config.replica_channel_socket or self.folder / NO_CHANNEL
        mounts.append(_mount(channel, CHANNEL_INSIDE))
        mounts.append(_mount(own / "scratch" / "tmp", "/tmp", writable=True))
        mounts.append(_mount(own / "scratch" / "shm", "/dev/shm", writable=True))
        # Read-only: the device still reads and writes (a mount's flag does not reach a
        # device's file operations), but its node's mode and owner, the node's own, stay
        # as they are whatever a snapshot phase run as uid 0, their owner, tries.
        for host, inside in device_mounts([str(d) for d in devices]):
            if os.path.exists(host):
                mounts.append(Mount(host, inside, mount_key(inside), device=True))
        for extra in filter(None, os.environ.get(WRITABLE_ENV, "").split(":")):
            if os.path.isdir(extra):
                mounts.append(_at_its_place(extra, writable=True))
        plan.mounts = _without_repeats(mounts)
        self.release(replica_id)
        own.mkdir(mode=0o700)
        mount_scratch(own / "scratch", TMP_BYTES)
        make_root(plan)
        for folder in SYS_LISTED:  # only mount points in them: listing shows nothing else
            with contextlib.suppress(FileNotFoundError):
                os.chmod(Path(plan.root + folder), 0o755)
        path = self.plan_path(replica_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(plan.to_bytes())
        return plan

    def release(self, replica_id: str) -> None:
        """Remove the replica's plan, root folder and scratch tmpfs (it has ended;
        blocking)."""
        unmount(self.folder / replica_id / "scratch")
        shutil.rmtree(self.folder / replica_id, ignore_errors=True)


def _image_mounts(
    plan: SandboxPlan, image: ImageRun, bundle_dir: Path, etc: Path, config: AgentConfig
) -> list[Mount]:
    """A replica on an image (image_replicas.py): the image's top-level entries, the
    node's resolv.conf and hosts over its own, Ember's runtime, the host's GPU driver
    files (with GPUs), the bundle and the CA; it starts in the image's working folder."""
    plan.image_root = os.path.realpath(image.root)
    plan.links = dict(image.links)
    plan.cwd = image.config.workdir
    mounts = [_mount(host, inside) for host, inside in image.entries]
    mounts += [
        _mount(etc / name, f"/etc/{name}") for name in ETC_FROM_NODE if (etc / name).is_file()
    ]
    mounts += [_mount(host, inside) for host, inside in image.runtime]
    plan.listable = [PACKAGES_INSIDE]  # on the path of a replica that never was root
    if image.driver is not None:  # a GPU replica's: the host's driver, whatever the image
        mounts += [_mount(host, inside) for host, inside in image.driver.mounts]
    mounts.append(_mount(bundle_dir, plan.inside(os.path.realpath(bundle_dir))))
    if config.ca_cert:
        mounts.append(_mount(config.ca_cert, CA_INSIDE))
    return mounts


def _without_repeats(mounts: list[Mount]) -> list[Mount]:
    seen: set[str] = set()
    kept = []
    for mount in mounts:
        if mount.target not in seen:
            seen.add(mount.target)
            kept.append(mount)
    return kept


def _mounts_under(folder: Path) -> list[Path]:
    """Mount points on the node below `folder`, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            point = Path(line.split()[4].replace("\\040", " "))
            if point.is_relative_to(folder):
                points.append(point)
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def _copy_etc(target: Path) -> None:
    """The node's /etc as replicas see it: ETC_ENTRIES copied (links kept as links), made
    when the worker starts."""
    target.mkdir(mode=0o755)
    for entry in ETC_ENTRIES:
        source, copy = Path("/etc") / entry, target / entry
        if not os.path.lexists(source):
            continue
        copy.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, copy, symlinks=True)
        else:
            shutil.copy2(source, copy, follow_symlinks=False)
