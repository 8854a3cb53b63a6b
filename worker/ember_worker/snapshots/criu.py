"""Process snapshots with CRIU (through pycriu, CRIU's RPC): take, publish, fetch, restore.

A snapshot is taken of a replica blocked at its quiet point (after `enter(snap=True)`,
before any connection), with the process left running. Its five pipes are external to
the image; a restore hands new pipes in their place (`inherit_fd`), so the restored
process talks to this agent and reads its new identity from the control pipe.

On a GPU node, the CUDA driver's checkpoint API (`cuda_checkpoint`) moves a replica's
device memory into host memory before the dump and back after it (and after a restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx

from ember.calling.tlsclient import client_context
from ember.wire.blob_downloads import DIRECT_HEADER
from ember_worker.processes.cgroups import joined
from ember_worker.processes.replica_processes import (
    ReplicaPipes,
    ReplicaProcess,
    adopt_restored,
    pipe_key,
)
from ember_worker.snapshots import cuda_checkpoint, mapped_weights, side_files
from ember_worker.snapshots.criu_images import PAGE_SIZE, PE_PARENT, PE_PRESENT
from ember_worker.snapshots.cuda_checkpoint import CudaCheckpointError

MIN_CRIU = (4, 1)
log = logging.getLogger("ember.worker")
CRIU_CANDIDATES = ("/usr/local/sbin/criu", "/usr/sbin/criu")
CRIU_BINARY_ENV = "EMBER_CRIU_BINARY"  # a CRIU kept elsewhere (bench/gpu_checks.sh's kit)
DUMP_TIMEOUT = 180.0
RESTORE_TIMEOUT = 30.0
# Seconds, for nodes where CRIU needs longer (huge images, slow disks), or shorter.
DUMP_TIMEOUT_ENV = "EMBER_CRIU_DUMP_TIMEOUT"
RESTORE_TIMEOUT_ENV = "EMBER_CRIU_RESTORE_TIMEOUT"
LAZY_SOCKET = "lazy-pages.socket"  # CRIU's name, in the restore's work dir
LAZY_DAEMON_START_TIMEOUT = 5.0
LAZY_PAGES_TIMEOUT = 300.0  # a restored process not fully in by then is killed
LOG_LEVEL = 2  # errors and warnings: what a failure report needs, without slowing dumps
WORK_PREFIXES = (".take-", ".publish-", ".fetch-", ".restore-")  # mkdtemp's, under root
T = TypeVar("T")


def timeout_from_env(name: str, default: float) -> float:
    """Seconds from the environment variable `name`, else `default` (ValueError naming
    the variable when it is not a positive number)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return seconds


class SnapshotError(Exception):
    """A dump, restore, upload or download failed; the message carries CRIU's own lines.
    `held_killed`: CRIU hung holding processes (a dump's replica), which were killed."""

    def __init__(self, message: str, held_killed: bool = False) -> None:
        super().__init__(message)
        self.held_killed = held_killed


@dataclass(frozen=True)
class SnapshotSupport:
    problem: str | None  # why this node cannot snapshot, or None
    criu_binary: str | None
    criu_version: str | None
    env_key: str  # what must match between the node that dumped and the one restoring
    lazy_pages: bool = False  # the kernel lets CRIU restore memory lazily (userfaultfd)

    def hello(self) -> dict[str, Any]:
        return {
            "problem": self.problem,
            "criu": self.criu_version,
            "env_key": self.env_key,
            "lazy_pages": self.lazy_pages,
        }


def _criu_binary() -> str | None:
    """$EMBER_CRIU_BINARY when set, else ours (infra/criu.sh), Debian's, then PATH's."""
    chosen = os.environ.get(CRIU_BINARY_ENV)
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    for candidate in CRIU_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("criu")


def _criu_version(binary: str) -> str | None:
    result = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return platform.machine()


def _gpu_identity() -> str:
    """GPU model and driver, from nvidia-smi when present; CUDA itself is never imported."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or "unknown"


def environment_key(criu_version: str | None) -> str:
    """A digest of what a restore depends on besides the bundle: interpreter, libraries,
    CRIU, kernel, CPU features and GPU (model and driver)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    parts = {
        "python": sys.version,
        "executable": sys.executable,
        "torch": torch_version,
        "criu": criu_version,
        "kernel": platform.release(),
        "cpu": _cpu_flags(),
        "gpu": _gpu_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def detect_support(pid_namespace_problem: str | None) -> SnapshotSupport:
    binary = _criu_binary()
    version = _criu_version(binary) if binary else None
    problem = None
    if pid_namespace_problem:
        problem = f"replicas cannot have their own PID namespace ({pid_namespace_problem})"
    elif binary is None and os.environ.get(CRIU_BINARY_ENV):
        problem = f"{CRIU_BINARY_ENV}={os.environ[CRIU_BINARY_ENV]} is not an executable file"
    elif binary is None:
        problem = "CRIU is not installed (infra/install.sh installs it, as root)"
    elif version is None or tuple(int(p) for p in version.split(".")[:2]) < MIN_CRIU:
        problem = f"CRIU {version} is too old; 4.1 or newer is needed"
    else:
        try:
            import pycriu  # noqa: F401
        except ImportError:
            problem = "pycriu is not installed in this environment (infra/install.sh)"
    if problem is None and binary is not None:
        check = subprocess.run([binary, "check"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            lines = (check.stderr or check.stdout).strip().splitlines()
            problem = "`criu check` fails: " + (lines[-1] if lines else "no output")
    lazy = False
    if problem is None and binary is not None:
        # Lazy restores need userfaultfd with fork/remap events (the restored process
        # may start threads and move memory while its pages are still arriving).
        feature = [binary, "check", "--feature", "uffd-noncoop"]
        lazy = subprocess.run(feature, capture_output=True, check=False).returncode == 0
    return SnapshotSupport(problem, binary, version, environment_key(version), lazy)


def check_pages(images: Path) -> None:
    """Every pages-*.img holds as many bytes as its pagemap says. CRIU 4.1.1 loops on a
    truncated one instead of failing, so this is checked before a restore."""
    import pycriu

    for pagemap in sorted(images.glob("pagemap-*.img")):
        try:
            with pagemap.open("rb") as handle:
                head, *entries = pycriu.images.load(handle)["entries"]
            expected = PAGE_SIZE * sum(
                e["nr_pages"]
                for e in entries
                if e.get("flags", 0) & PE_PRESENT and not e.get("flags", 0) & PE_PARENT
            )
            pages = images / f"pages-{head['pages_id']}.img"
            size = pages.stat().st_size if pages.exists() else 0
        except (OSError, ValueError, KeyError, pycriu.images.MagicException) as exc:
            raise SnapshotError(f"the image's {pagemap.name} is unreadable: {exc}") from None
        if size != expected:
            raise SnapshotError(
                f"the image is truncated: {pages.name} has {size} bytes, its pagemap "
                f"says {expected}"
            )


def criu_error_lines(log: Path, limit: int = 8) -> str:
    """CRIU's own error lines from its log, for the replica's log and the control plane."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [
        line.strip()
        for line in lines
        if ("Error" in line or "error" in line) and not any(h in line for h in HARMLESS)
    ]
    return " | ".join((errors or lines)[-limit:]) or "(empty CRIU log)"


# Error lines CRIU writes on every run here that say nothing about a failure.
HARMLESS = ("RLIMIT_NOFILE",)

PIPE_ROLES = ("lifeline", "stdout", "stderr", "control", "status")


def _child_end(pipes: ReplicaPipes, role: str) -> int:
    return {
        "lifeline": pipes.child_stdin,
        "stdout": pipes.child_stdout,
        "stderr": pipes.child_stderr,
        "control": pipes.child_control,
        "status": pipes.child_status,
    }[role]


def _agent_end(pipes: ReplicaPipes, role: str) -> int:
    return getattr(pipes, role)


class _SwrkChannel:
    """How pycriu reaches `criu swrk`, started with `subprocess` instead of pycriu's own
    `os.fork()`: the agent has threads, and a child that runs Python between fork and exec
    can block forever on a lock another thread held at the fork (seen: a dump "hung" for
    180 s). subprocess forks and execs in C. pycriu calls only connect and disconnect."""

    def __init__(self, binary: str, cgroup_procs: Sequence[Path] = ()) -> None:
        self.binary = binary
        self.cgroup_procs = cgroup_procs  # the cgroups CRIU restores the replica in
        self.swrk: int | None = None  # the pid, for _CriuCall.kill
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None

    def connect(self, daemon: bool) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        try:
            # close_fds=False: inheritable descriptors (a restore's pipes) must reach CRIU.
            command = [self.binary, "swrk", str(theirs.fileno())]
            command = joined(command, self.cgroup_procs)
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=False,
            )
        finally:
            theirs.close()
        self.swrk = self._process.pid
        self._socket = ours
        return ours

    def disconnect(self) -> None:
        if self._socket is not None:
            self._socket.close()
        if self._process is not None:
            self._process.wait()


class _CriuCall:
    """One pycriu request run in a thread, killable on timeout (CRIU's swrk process)."""

    active: ClassVar[set[_CriuCall]] = set()  # calls in flight, for abort_all()

    def __init__(self, binary: str, cgroup_procs: Sequence[Path] = ()) -> None:
        import pycriu

        self.pycriu = pycriu
        self.criu = pycriu.criu()
        self.criu._comm = _SwrkChannel(binary, cgroup_procs)

    @classmethod
    def abort_all(cls) -> None:
        for call in list(cls.active):
            call.kill()

    def kill(self) -> int:
        """End the call: kill CRIU's swrk process and every task it traces (a half-restored
        one, or a replica it was dumping: CRIU's parasite code may be in it); how many
        such tasks there were."""
        # pycriu keeps the swrk pid on its private comm object.
        swrk = getattr(getattr(self.criu, "_comm", None), "swrk", None)
        if not swrk:
            return 0
        traced = 0
        for task in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, ValueError):
                status = (task / "status").read_text()
                if f"\nTracerPid:\t{swrk}\n" in status:
                    os.kill(int(task.name), signal.SIGKILL)
                    traced += 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(swrk, signal.SIGKILL)
        return traced

    async def run(self, request: str, timeout: float) -> Any:
        call = getattr(self.criu, request)
        task = asyncio.ensure_future(asyncio.to_thread(call))
        self.active.add(self)
        task.add_done_callback(lambda _: self.active.discard(self))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            # Never leave the thread blocked on CRIU: it would hold up the agent's exit.
            traced = self.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
            if isinstance(exc, asyncio.CancelledError):
                raise
            held = f" holding {traced} process(es), killed with it" if traced else ""
            raise SnapshotError(
                f"CRIU {request} timed out after {timeout:g} s{held}", held_killed=bool(traced)
            ) from None


class LazyPagesDaemon:
    """`criu lazy-pages` for one restore: it listens in the restore's work dir, serves
    the restored process's page faults from the image, pushes the remaining pages in the
    background, and exits once every page is in (or the process has gone)."""

    active: ClassVar[set[LazyPagesDaemon]] = set()  # running daemons, for kill_all()

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log
        self.started = time.monotonic()

    @classmethod
    async def start(cls, binary: str, images: Path, work: Path) -> LazyPagesDaemon:
        log = work / "lazy-pages.log"
        process = await asyncio.create_subprocess_exec(
            binary,
            "lazy-pages",
            "--images-dir",
            str(images),
            "--work-dir",
            str(work),
            "--log-file",
            log.name,
            f"-v{LOG_LEVEL}",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        daemon = cls(process, log)
        cls.active.add(daemon)
        deadline = time.monotonic() + LAZY_DAEMON_START_TIMEOUT
        while not (work / LAZY_SOCKET).exists():
            if process.returncode is not None or time.monotonic() > deadline:
                daemon.kill()
                await daemon.wait()
                raise SnapshotError(
                    f"CRIU's lazy-pages daemon did not start: {criu_error_lines(log)}"
                )
            await asyncio.sleep(0.002)
        return daemon

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code; None (and killed) if it runs past `timeout`."""
        try:
            return await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            self.kill()
            await self.process.wait()
            return None
        finally:
            if self.process.returncode is not None:
                self.active.discard(self)

    @classmethod
    def kill_all(cls) -> None:
        for daemon in list(cls.active):
            daemon.kill()


def image_meta(images: Path) -> dict[str, Any]:
    """What the dump recorded beside an image (meta.json): its key, pipes, GPU state."""
    try:
        meta = json.loads((images / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"the image has no readable meta.json: {exc}") from None
    if not isinstance(meta, dict):
        raise SnapshotError("the image's meta.json is not an object")
    return meta


def restores_lazily(requested: bool, support: SnapshotSupport, meta: dict[str, Any]) -> bool:
    """Whether a restore from an image with `meta` is lazy: asked for, allowed by this
    node's kernel, and the image holds no GPU state. The driver copies that back to the
    device at once after the restore, which through userfaultfd would be page by page,
    for no gain, and it has never been tried."""
    return requested and support.lazy_pages and not meta.get("cuda")


def image_name(key: str, image_id: str | None) -> str:
    """The cache folder of one image of `key`. The key is what must match to restore;
    each dump of it is an image of its own. A key dropped and taken again (`ember snapshot
    rm`, a failed restore) gets a new image, which a node holding the old one must not
    mistake for it. Images from before image ids have the key alone."""
    return f"{key}-{image_id}" if image_id else key


class Snapshotter:
    def __init__(
        self,
        support: SnapshotSupport,
        root: Path,
        server_url: str,
        token: str,
        ca_cert: str | None,
        budget_bytes: int,
        same_on_every_node: Sequence[Path] = (),
        weights_objects: Path | None = None,
    ) -> None:
        self.support = support
        self.root = root
        # The node's weights cache files (`mapped_weights`): a restore maps them again.
        self.weights_objects = weights_objects
        # Files under these are not carried in images (`side_files`): every node has them.
        self.stable_roots = side_files.stable_roots(same_on_every_node)
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.ca_cert = ca_cert
        self.budget_bytes = budget_bytes
        self.dump_timeout = timeout_from_env(DUMP_TIMEOUT_ENV, DUMP_TIMEOUT)
        self.restore_timeout = timeout_from_env(RESTORE_TIMEOUT_ENV, RESTORE_TIMEOUT)
        self.in_use: dict[str, int] = {}
        self._fetching: dict[str, asyncio.Lock] = {}
        self._fetching_ahead = asyncio.Lock()
        self._lazy_watchers: set[asyncio.Task[None]] = set()
        # CUDA checkpointing: None on machines without an NVIDIA GPU (no CUDA import).
        self.cuda, self.cuda_problem = cuda_checkpoint.detect()
        root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Work folders of takes, publishes, fetches and restores that a killed worker
        left: none of them is in use as a worker starts, and the cache's collection does
        not see them (a 300 MB half-fetched image stayed for good)."""
        for entry in self.root.iterdir():
            if entry.name.startswith(WORK_PREFIXES) and entry.is_dir():
                log.warning("removing %s, left by a worker that did not end cleanly", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def _dir(self, key: str, image_id: str | None) -> Path:
        return self.root / image_name(key, image_id)

    async def _gpu(self, func: Callable[..., T], *args: Any) -> T:
        """A blocking CUDA checkpoint step, in a thread; its failure as a SnapshotError."""
        try:
            return await asyncio.to_thread(func, *args)
        except CudaCheckpointError as exc:
            raise SnapshotError(f"GPU checkpoint: {exc}") from None

    async def _gpu_resume(self, process: ReplicaProcess) -> None:
        """Give the dumped original its GPU state back; if that fails it cannot use the
        GPU again, so it is killed (and replaced by a cold boot)."""
        if self.cuda is None:
            return
        try:
            await self._gpu(self.cuda.resume, process.pid)
        except SnapshotError as exc:
            process.kill()
            raise SnapshotError(f"{exc}; the replica was stopped") from None

    # ----- take -----------------------------------------------------------------
    async def dump(
        self,
        key: str,
        process: ReplicaProcess,
        gpus: Sequence[str] = (),
        weights: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """Dump `process` (left running) into this node's cache; returns its metadata.
        Replicas on this node can restore from it at once; `publish` shares it. `gpus`:
        the visible ids of the GPUs the process holds (a restore elsewhere maps them);
        `weights`: the weights objects it read, with their versions (a restored replica
        checks them before it serves)."""
        if self.support.criu_binary is None:
            raise SnapshotError("CRIU is not available")
        work = Path(tempfile.mkdtemp(prefix=f".take-{key[:12]}-", dir=self.root))
        images = work / "images"
        images.mkdir()
        started = time.monotonic()
        image_id = secrets.token_hex(6)
        try:
            meta: dict[str, Any] = {
                "key": key,
                "image_id": image_id,
                "pipes": {role: pipe_key(_agent_end(process.pipes, role)) for role in PIPE_ROLES},
                "created_at": time.time(),
                "gpus": list(gpus),
                "weights": list(weights),
            }
            gpu = await self._gpu(
                cuda_checkpoint.needs_checkpoint, self.cuda, self.cuda_problem, process.pid
            )
            used = await asyncio.to_thread(side_files.files_of_tree, process.pid)
            carried = side_files.to_carry(used, self.stable_roots)
            if self.weights_objects is not None:
                meta["mapped_weights"] = mapped_weights.find(used, self.weights_objects)
            call = _CriuCall(self.support.criu_binary)
            images_fd = os.open(images, os.O_DIRECTORY)
            try:
                if gpu and self.cuda is not None:  # lock, device memory to host memory
                    meta["cuda_seconds"] = await self._gpu(self.cuda.checkpoint, process.pid)
                opts = call.criu.opts
                opts.images_dir_fd = images_fd
                opts.log_file = "dump.log"
                opts.log_level = LOG_LEVEL
                opts.pid = process.pid
                opts.leave_running = True
                opts.shell_job = False
                await call.run("dump", self.dump_timeout)
            except (call.pycriu.CRIUException, SnapshotError) as exc:
                # A timeout too: what CRIU logged says where it hung.
                lines = criu_error_lines(images / "dump.log")
                held = isinstance(exc, SnapshotError) and exc.held_killed
                raise SnapshotError(f"{exc}: {lines}", held_killed=held) from None
            finally:
                os.close(images_fd)
                if gpu:  # after a dump or a failure alike: restore and unlock
                    await self._gpu_resume(process)
            (images / "dump.log").unlink(missing_ok=True)
            packed = await asyncio.to_thread(side_files.pack, carried, images)
            meta["side_files"] = {"files": packed.files, "bytes": packed.bytes}
            if packed.skipped:
                # Restores on this node still work; elsewhere they fall back to cold boots.
                meta["side_files"]["skipped"] = packed.skipped[:20]
            meta["cuda"] = gpu
            meta["dump_seconds"] = time.monotonic() - started
            meta["raw_size"] = sum(p.stat().st_size for p in images.iterdir())
            # meta.json last: its presence marks a complete image in the cache.
            (images / "meta.json").write_text(json.dumps(meta))
            target = self._dir(key, image_id)
            os.replace(work, target)
            # The new image stays, whatever its size.
            self.in_use[target.name] = self.in_use.get(target.name, 0) + 1
            try:
                await asyncio.to_thread(self.collect_garbage)
            finally:
                self.in_use[target.name] -= 1
            return meta
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def publish(self, key: str, image_id: str) -> dict[str, Any]:
        """Compress this node's image `image_id` of `key` and upload it to the control
        plane's blob store, for every other node; returns its metadata with the
        compressed size."""
        folder = self._dir(key, image_id)
        images = folder / "images"
        meta = json.loads((images / "meta.json").read_text())
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".publish-{key[:12]}-", dir=self.root))
        self.in_use[folder.name] = self.in_use.get(folder.name, 0) + 1  # not collected while read
        try:
            archive = work / "image.tar.zst"
            await asyncio.to_thread(_pack, images, archive)
            meta["size"] = archive.stat().st_size
            await self._upload(key, archive)
        except OSError as exc:
            raise SnapshotError(f"snapshot {key} could not be packed: {exc}") from None
        finally:
            self.in_use[folder.name] -= 1
            shutil.rmtree(work, ignore_errors=True)
        meta["publish_seconds"] = time.monotonic() - started
        return meta

    async def _upload(self, key: str, archive: Path) -> None:
        def chunks() -> Iterator[bytes]:
            with archive.open("rb") as handle:
                while chunk := handle.read(4 * 1024 * 1024):
                    yield chunk

        try:
            async with httpx.AsyncClient(
                verify=client_context(self.ca_cert), timeout=600
            ) as client:
                response = await client.put(
                    f"{self.server_url}/v1/snapshots/{key}",
                    content=_aiter(chunks()),
                    headers={"Authorization": f"Bearer {self.token}"},
                )
        except httpx.HTTPError as exc:
            raise SnapshotError(f"upload of snapshot {key} failed: {exc}") from None
        if response.status_code != 201:
            raise SnapshotError(f"upload of snapshot {key} failed: HTTP {response.status_code}")

    # ----- restore --------------------------------------------------------------
    async def fetch(self, key: str, image_id: str | None) -> Path:
        """The folder of image `image_id` of `key` on this node: from the node cache, or
        downloaded once (the blob store holds the key's current image)."""
        folder = self._dir(key, image_id)
        images = folder / "images"
        if (images / "meta.json").exists():
            os.utime(folder)  # recently used: the last to be collected
            return images
        lock = self._fetching.setdefault(folder.name, asyncio.Lock())
        async with lock:
            if (images / "meta.json").exists():
                return images
            work = Path(tempfile.mkdtemp(prefix=f".fetch-{key[:12]}-", dir=self.root))
            try:
                archive = work / "image.tar.zst"
                await self._download(key, archive)
                (work / "images").mkdir()
                await asyncio.to_thread(_unpack, archive, work / "images")
                archive.unlink()
                fetched = image_meta(work / "images")
                if image_id and fetched.get("image_id") != image_id:
                    # Dropped and taken again since the replica was planned: restoring the
                    # newer image would be right, but under the old one's folder it would
                    # be wrong for the next replica.
                    raise SnapshotError(
                        f"snapshot {key} is image {fetched.get('image_id')} now, not {image_id}"
                    )
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(work, folder)
            except (OSError, tarfile.TarError, ValueError) as exc:
                raise SnapshotError(f"snapshot {key} is unreadable: {exc}") from None
            finally:
                shutil.rmtree(work, ignore_errors=True)
        self.collect_garbage()
        return images

    async def _download(self, key: str, archive: Path) -> None:
        """The key's packed image into `archive`: from the blob store itself when the
        control plane gives its URL (a bucket), else, or should that fail, through the
        control plane."""
        url = f"{self.server_url}/v1/snapshots/{key}"
        auth = {"Authorization": f"Bearer {self.token}"}
        headers = {**auth, DIRECT_HEADER: "1"}
        direct = await _get(url, headers, self.ca_cert, key, archive, redirect_ok=True)
        if direct is None:
            return
        began = time.monotonic()
        try:
            # The bucket's own TLS: the system's trust, not the platform's CA.
            await _get(direct, {}, None, key, archive)
        except (httpx.HTTPError, SnapshotError) as exc:
            log.warning(
                "snapshot %s: the blob store's URL failed (%s); through the control plane",
                key[:12],
                exc,
            )
        else:
            log.info(
                "snapshot %s downloaded from the blob store directly (%.0f MB in %.2f s)",
                key[:12],
                archive.stat().st_size / 1e6,
                time.monotonic() - began,
            )
            return
        await _get(url, auth, self.ca_cert, key, archive)

    @staticmethod
    def abort_all() -> None:
        """Kill CRIU calls in flight (the agent is stopping): their threads must end."""
        _CriuCall.abort_all()
        LazyPagesDaemon.kill_all()

    def forget(self, key: str, image_id: str | None) -> None:
        """Drop a local image (a restore from it failed: it may be corrupt), unless a
        restore or a publish is reading it now."""
        folder = self._dir(key, image_id)
        if not self.in_use.get(folder.name):
            shutil.rmtree(folder, ignore_errors=True)

    def forget_key(self, key: str) -> list[str]:
        """Drop every local image of `key` (the control plane dropped it) that nothing
        reads now (the rest go with the cache's garbage collection); their folders."""
        removed = []
        for path in self.root.iterdir():
            if path.name != key and not path.name.startswith(f"{key}-"):
                continue
            if not self.in_use.get(path.name):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def cached(self) -> list[tuple[str, str]]:
        """(key, image id) of each complete image in this node's cache."""
        images = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not (path / "images" / "meta.json").exists():
                continue
            key, _, image_id = path.name.partition("-")
            images.append((key, image_id))
        return images

    async def restore(
        self,
        images: Path,
        pipes: ReplicaPipes,
        lazy: bool = False,
        on_pages_in: Callable[[float, str | None], None] | None = None,
        gpu_pairs: Sequence[tuple[str, str]] = (),
        cgroup_procs: Sequence[Path] = (),
    ) -> ReplicaProcess:
        """Restore a replica from `images`, its pipes handed in for the image's, into
        the cgroups of `cgroup_procs` (else the agent's).

        Lazy (`restores_lazily`): the process runs as soon as its non-memory
        state is back; CRIU's lazy-pages daemon gives it each page on first touch and
        copies the rest in the background. `on_pages_in(seconds, error)` is called when
        all of its memory is in (or never will be: then the process has been killed).
        `gpu_pairs` (old UUID, new UUID) move the image's GPU state onto other GPUs."""
        if self.support.criu_binary is None:
            raise SnapshotError("CRIU is not available")
        meta = image_meta(images)
        if meta.get("cuda") and self.cuda is None:
            why = self.cuda_problem or "this node has no NVIDIA GPU"
            raise SnapshotError(f"the image holds GPU state this node cannot restore: {why}")
        lazy = restores_lazily(lazy, self.support, meta)
        await asyncio.to_thread(check_pages, images)
        try:
            await asyncio.to_thread(side_files.put_back, images)
        except (OSError, tarfile.TarError) as exc:
            raise SnapshotError(f"the files the image needs could not be put back: {exc}") from None
        work = Path(tempfile.mkdtemp(prefix=".restore-", dir=self.root))
        name = images.parent.name  # its folder in the cache: not collected while read
        self.in_use[name] = self.in_use.get(name, 0) + 1
        daemon: LazyPagesDaemon | None = None
        try:
            if lazy:
                daemon = await LazyPagesDaemon.start(self.support.criu_binary, images, work)
            call = _CriuCall(self.support.criu_binary, cgroup_procs)
            images_fd = os.open(images, os.O_DIRECTORY)
            work_fd = os.open(work, os.O_DIRECTORY)
            try:
                opts = call.criu.opts
                opts.images_dir_fd = images_fd
                opts.work_dir_fd = work_fd
                opts.log_file = "restore.log"
                opts.log_level = LOG_LEVEL
                opts.rst_sibling = True  # the restored replica is our child: we reap it
                opts.shell_job = False
                opts.lazy_pages = lazy
                # The replica stays in the cgroups CRIU runs in (see replica_cgroups.py), not
                # those of the process the image was taken from: another replica's.
                opts.manage_cgroups_mode = call.pycriu.rpc.IGNORE
                for role in PIPE_ROLES:
                    fd = _child_end(pipes, role)
                    os.set_inheritable(fd, True)  # CRIU's swrk process must get it
                    entry = opts.inherit_fd.add()
                    entry.key = meta["pipes"][role]
                    entry.fd = fd
                response = await call.run("restore", self.restore_timeout)
            except (call.pycriu.CRIUException, SnapshotError) as exc:
                lines = criu_error_lines(work / "restore.log")
                if daemon is not None:
                    lines += " | lazy pages: " + criu_error_lines(daemon.log)
                raise SnapshotError(f"{exc}: {lines}") from None
            finally:
                os.close(images_fd)
                os.close(work_fd)
            process = adopt_restored(int(response.pid), pipes)
            if meta.get("cuda") and self.cuda is not None:
                try:  # host memory back to the device, then unlock
                    await self._gpu(self.cuda.restore, process.pid, gpu_pairs)
                except SnapshotError:
                    process.kill()
                    await process.wait()  # reaped here: the agent never adopts it
                    raise
        except BaseException:
            if daemon is not None:
                daemon.kill()
                await daemon.wait()
            self.in_use[name] -= 1
            shutil.rmtree(work, ignore_errors=True)
            raise
        if daemon is None:
            self.in_use[name] -= 1
            shutil.rmtree(work, ignore_errors=True)
        else:
            # The image and the work dir stay until the daemon has handed every page over.
            task = asyncio.ensure_future(
                self._watch_lazy_pages(daemon, process, name, work, on_pages_in)
            )
            self._lazy_watchers.add(task)
            task.add_done_callback(self._lazy_watchers.discard)
        return process

    async def _watch_lazy_pages(
        self,
        daemon: LazyPagesDaemon,
        process: ReplicaProcess,
        name: str,
        work: Path,
        on_pages_in: Callable[[float, str | None], None] | None,
    ) -> None:
        error: str | None = None
        try:
            returncode = await daemon.wait(LAZY_PAGES_TIMEOUT)
            if returncode is None:
                error = f"not all pages were in after {LAZY_PAGES_TIMEOUT:g} s"
            elif returncode != 0:
                # It exits 0 when its replica ends first: anything else is its own failure.
                error = f"exit code {returncode}: {criu_error_lines(daemon.log)}"
            if error is not None:
                process.kill()  # it would wait forever on a page that never comes
        finally:
            self.in_use[name] -= 1
            shutil.rmtree(work, ignore_errors=True)
        if on_pages_in is not None and (error is not None or process.returncode is None):
            on_pages_in(time.monotonic() - daemon.started, error)

    # ----- garbage collection ---------------------------------------------------
    async def fetch_ahead(self, key: str, image_id: str | None, size: int) -> float | None:
        """Fetch an image before a replica here needs it, if it fits in the cache beside
        what it holds (evicting nothing), one at a time so each sees the room the last
        left; the seconds it took, or None when it was not fetched (a failure costs only
        the head start: a restore fetches it then)."""
        async with self._fetching_ahead:
            if self.has(key, image_id):
                return None
            if not await asyncio.to_thread(self.room_for, size):
                log.info(
                    "not fetching snapshot %s ahead (%.0f MB): the node's snapshot cache has "
                    "no room for it without evicting others (--snapshot-cache-gb)",
                    key[:12],
                    size / 1e6,
                )
                return None
            began = time.monotonic()
            try:
                await self.fetch(key, image_id)
            except SnapshotError as exc:
                log.warning("fetching snapshot %s ahead failed: %s", key[:12], exc)
                return None
            return time.monotonic() - began

    def has(self, key: str, image_id: str | None) -> bool:
        """Whether the image is in this node's cache."""
        return (self._dir(key, image_id) / "images" / "meta.json").exists()

    def room_for(self, size: int) -> bool:
        """Whether an image of `size` bytes fits in the cache beside what it holds, so that
        fetching it ahead of need would evict nothing."""
        return sum(size for _, size, _ in self._entries()) + size <= self.budget_bytes

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last used, bytes, folder) of each image in the cache."""
        entries = []
        for path in self.root.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            # By inode: a huge-page view of an image hard-links its files (huge_pages.py).
            files = {}
            for f in path.rglob("*"):
                stat = f.lstat()
                if f.is_file() and not f.is_symlink():
                    files[stat.st_ino] = stat.st_size
            entries.append((path.stat().st_mtime, sum(files.values()), path))
        return entries

    def collect_garbage(self) -> list[str]:
        """Remove the least recently used images until the cache fits its budget."""
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, path in sorted(entries):
            if total <= self.budget_bytes:
                break
            if self.in_use.get(path.name):
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed.append(path.name)
        return removed


async def _aiter(chunks: Iterator[bytes]) -> Any:
    for chunk in chunks:
        yield chunk


def _pack(images: Path, archive: Path) -> None:
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3, threads=-1)
    with (
        archive.open("wb") as raw,
        compressor.stream_writer(raw) as stream,
        tarfile.open(fileobj=stream, mode="w|") as tar,
    ):
        for path in sorted(images.iterdir()):
            if not path.name.endswith(".log"):
                tar.add(path, arcname=path.name)
    # Each TarInfo points back at its TarFile: left alone, that cycle keeps the compressor
    # and its worker threads until some garbage collection, in whatever thread runs it.
    tar.members.clear()  # type: ignore[attr-defined]  # (not in typeshed)


async def _get(
    url: str,
    headers: dict[str, str],
    ca_cert: str | None,
    key: str,
    archive: Path,
    redirect_ok: bool = False,
) -> str | None:
    """The packed image at `url` into `archive`; or, with `redirect_ok`, the URL a 307
    sends it to, and nothing written."""
    async with (
        httpx.AsyncClient(verify=client_context(ca_cert), timeout=600) as client,
        client.stream("GET", url, headers=headers) as response,
    ):
        if redirect_ok and response.status_code == 307 and "location" in response.headers:
            return str(response.headers["location"])
        if response.status_code != 200:
            raise SnapshotError(f"snapshot {key} is not available: HTTP {response.status_code}")
        with archive.open("wb") as handle:
            async for chunk in response.aiter_bytes(4 * 1024 * 1024):
                handle.write(chunk)
    return None


def _unpack(archive: Path, images: Path) -> None:
    import zstandard

    with (
        archive.open("rb") as raw,
        zstandard.ZstdDecompressor().stream_reader(raw) as stream,
        tarfile.open(fileobj=stream, mode="r|") as tar,
    ):
        tar.extractall(images, filter="data")
