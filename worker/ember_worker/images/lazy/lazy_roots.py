"""Image roots served lazily: one FUSE mount per image per node (`mount_process.py`, a
process of its own, ending when the agent does: a lifeline pipe, as for replicas),
shared by every replica of the image there, whose files' bytes come on first read.
Where FUSE cannot be used (no /dev/fuse, no pyfuse3, not root and
no fusermount3) or the image cannot be indexed or mounted, the image is extracted whole
instead (`ExtractedImageRoots`), and `how(image)` says which, and why.

Layout under the worker's folder: `image-mounts/<digest hex>` the mount points,
`image-mounts/<hex>.stats` each mount's counts, `image-indexes/` the indexes used,
`image-cache/` the node's disk cache of layer tars' chunks."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ember.images.image import Image
from ember_worker.images.image_roots import (
    MOUNT_POINTS,
    ExtractedImageRoots,
    ImageRootError,
    ImageRoots,
    NodeRoot,
    python_in,
)
from ember_worker.images.layer_store import LayerStore, LayerStoreError
from ember_worker.images.lazy.file_index import UnindexableImage
from ember_worker.images.lazy.image_indexes import index_file
from ember_worker.processes.process_env import ROOT_ENV

log = logging.getLogger("ember.worker.images")

MOUNTS_DIR = "image-mounts"
INDEXES_DIR = "image-indexes"
CACHE_DIR = "image-cache"
FSTYPE = "fuse.ember"
READY_SECONDS = 30.0
STOP_SECONDS = 5.0
# "extracted" makes every root an extraction (an operator's choice, or a baseline).
MODE_ENV = "EMBER_IMAGE_ROOTS"
CACHE_BYTES_ENV = "EMBER_IMAGE_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 50 * 2**30


class MountError(Exception):
    pass


def fuse_unavailable() -> str | None:
    """Why this node cannot serve lazy roots, or None when it can."""
    if os.environ.get(MODE_ENV) == "extracted":
        return f"{MODE_ENV}=extracted"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as error:
        return f"/dev/fuse cannot be opened: {error.strerror}"
    if importlib.util.find_spec("pyfuse3") is None:
        return "pyfuse3 is not installed (bash infra/install.sh installs it)"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "the worker is not root and fusermount3 is missing"
    return None


def mounted(path: Path) -> bool:
    """Whether an image file system is mounted at `path` in this mount namespace."""
    where = os.fsencode(str(path))
    with open("/proc/self/mountinfo", "rb") as info:
        for line in info:
            fields = line.split()
            dash = fields.index(b"-")
            if fields[4] == where and fields[dash + 1].decode() == FSTYPE:
                return True
    return False


def unmount(path: Path) -> None:
    """Detach a mount whose process is gone (or going): its users see errors, new
    ones find nothing there."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


class LazyImageRoots(ImageRoots):
    def __init__(
        self,
        store: LayerStore,
        folder: Path,
        ca_cert: str | None,
        *,
        cache_bytes: int | None = None,
        memory_bytes: int = 256 * 2**20,
        servers: Sequence[str] = (),
    ) -> None:
        super().__init__(store)
        self.folder = folder
        self.mounts = folder / MOUNTS_DIR
        self.extracted = ExtractedImageRoots(store, folder)
        self.ca_cert = ca_cert
        self.cache_bytes = cache_bytes or int(
            os.environ.get(CACHE_BYTES_ENV) or DEFAULT_CACHE_BYTES
        )
        self.memory_bytes = memory_bytes
        # Every control-plane process of the platform: a mount reads on from the next
        # when its own is gone (they share one store).
        self.servers = list(servers)
        self.unavailable = fuse_unavailable()
        self._how: dict[str, dict[str, str]] = {}
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._lifelines: dict[str, int] = {}  # by image: the write end of its lifeline
        self._used: dict[str, float] = {}  # when a replica last asked, by image

    def how(self, image: Image) -> dict[str, str]:
        """{"root": "lazy" | "extracted", "why": ...} for an image this node made a root of."""
        return self._how.get(image.digest, {"root": "", "why": ""})

    def describe(self, digest: str) -> str:
        """`lazy`, or `extracted (why)`: for a replica's start report (`ember ls`)."""
        how = self._how.get(digest, {})
        if how.get("root") == "extracted" and how.get("why"):
            return f"extracted ({how['why']})"
        return how.get("root", "")

    def mount_point(self, image: Image) -> Path:
        return self.mounts / image.digest.removeprefix("sha256:")

    def stats(self, image: Image) -> dict[str, int]:
        """The mount's counts: bytes and requests from the store, chunks refused."""
        try:
            data = json.loads(self.mount_point(image).with_suffix(".stats").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    async def root_for(self, image: Image) -> Path:
        self._used[image.digest] = time.time()
        async with self.lock_for(image.digest):
            why = self.unavailable
            if why is None:
                try:
                    root = await self._lazy(image)
                except (UnindexableImage, MountError, LayerStoreError, OSError, ValueError) as exc:
                    why = f"the lazy file system failed: {exc}"
                    log.warning("image %s: %s; extracting it", image.digest[7:19], why)
                else:
                    self._how[image.digest] = {"root": "lazy", "why": ""}
                    return root
        root = await self.extracted.root_for(image)
        self._how[image.digest] = {"root": "extracted", "why": why}
        return root

    async def _lazy(self, image: Image) -> Path:
        path = self.mount_point(image)
        if image.digest not in self._processes or not _alive(path):
            index_path = await asyncio.to_thread(
                index_file, self.store, image.digest, self.folder / INDEXES_DIR
            )
            config = await self.config_for(image)
            await asyncio.to_thread(self._mount, image.digest, index_path, config.workdir)
        if python_in(path) is None:
            raise ImageRootError(
                f"image {image.digest[7:19]} has no Python of the worker's version (docs/images.md)"
            )
        return path

    def _mount(self, digest: str, index_path: Path, workdir: str) -> None:
        """The image mounted at its mount point, unless a live mount is there already
        (another agent's on this node, or this one's before a restart)."""
        hex_digest = digest.removeprefix("sha256:")
        path = self.mounts / hex_digest
        self.mounts.mkdir(mode=0o755, parents=True, exist_ok=True)
        with (self.mounts / f".{hex_digest}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if mounted(path):
                if _alive(path):
                    return
                unmount(path)
            path.mkdir(mode=0o755, exist_ok=True)
            token_file = self.mounts / ".store-token"
            _write_private(token_file, _token(self.store))
            argv = [
                sys.executable,
                "-m",
                "ember_worker.images.lazy.mount_process",
                "--index",
                str(index_path),
                "--mountpoint",
                str(path),
                "--store",
                ",".join(self._servers()),
                "--token-file",
                str(token_file),
                "--cache",
                str(self.folder / CACHE_DIR),
                "--cache-bytes",
                str(self.cache_bytes),
                "--memory-bytes",
                str(self.memory_bytes),
                "--stats",
                str(path.with_suffix(".stats")),
                "--mount-dir",
                workdir,
            ]
            for name in MOUNT_POINTS:
                argv += ["--mount-file", name]
            if self.ca_cert:
                argv += ["--ca", self.ca_cert]
            log_path = path.with_suffix(".log")
            # Its lifeline: the mount ends when this end closes, the agent's end too.
            _close(self._lifelines.pop(digest, None))  # a mount of it that ended
            reading, writing = os.pipe()
            argv += ["--lifeline", str(reading)]
            try:
                with log_path.open("ab") as errors:
                    process = subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=errors,
                        pass_fds=(reading,),
                        start_new_session=True,  # the agent's signals are the agent's
                        env={**ROOT_ENV, "PYTHONPATH": _package_path()},  # all else by argument
                    )
            except BaseException:
                os.close(writing)
                raise
            finally:
                os.close(reading)
            if not _ready(process):
                os.close(writing)
                process.kill()
                process.wait()
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise MountError("the mount did not start: " + " | ".join(tail))
            self._processes[digest] = process
            self._lifelines[digest] = writing

    def present(self) -> list[NodeRoot]:
        """Mounts (this agent's, or an earlier one's still there) and extracted roots."""
        roots = self.extracted.present()
        names = os.listdir(self.mounts) if self.mounts.is_dir() else []
        for name in names:
            if len(name) == 64 and not name.startswith("."):
                digest = "sha256:" + name
                roots.append(NodeRoot(digest, "lazy", 0, self._used.get(digest, 0.0)))
        return roots

    def remove(self, digest: str) -> None:
        """Its mount stopped and unmounted, its files here, and an extracted root."""
        super().remove(digest)
        path = self.mounts / digest.removeprefix("sha256:")
        process = self._processes.pop(digest, None)
        if process is not None:
            _stop({digest: process}, self.mounts)
            _close(self._lifelines.pop(digest, None))
            # Its file index too, unless another mount reads the same one.
            index = _argument(process, "--index")
            others = list(self._processes.values())
            if index and all(_argument(p, "--index") != index for p in others):
                Path(index).unlink(missing_ok=True)
        if mounted(path):  # an earlier agent's: its process ends with the mount
            unmount(path)
        with contextlib.suppress(OSError):
            path.rmdir()
        for leftover in (path.with_suffix(".stats"), path.with_suffix(".log")):
            leftover.unlink(missing_ok=True)
        (self.mounts / f".{path.name}.lock").unlink(missing_ok=True)
        self._how.pop(digest, None)
        self._used.pop(digest, None)
        self.extracted.remove(digest)

    def _servers(self) -> list[str]:
        """The store's server first, then the platform's others (`servers`)."""
        first = str(self.store.client.base_url).rstrip("/")
        return [first, *(u.rstrip("/") for u in self.servers if u.rstrip("/") != first)]

    def close(self) -> None:
        """Unmount what this instance mounted (the agent's stop: its replicas are gone)."""
        _stop(self._processes, self.mounts)
        self._processes.clear()
        for writing in self._lifelines.values():
            _close(writing)
        self._lifelines.clear()


def _close(descriptor: int | None) -> None:
    if descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(descriptor)


def _argument(process: subprocess.Popen[bytes], option: str) -> str | None:
    """The value a mount process was started with for `option`."""
    argv = [str(a) for a in process.args] if isinstance(process.args, list) else []
    return argv[argv.index(option) + 1] if option in argv[:-1] else None


def _stop(processes: dict[str, subprocess.Popen[bytes]], mounts: Path) -> None:
    """Mount processes asked to unmount and end (killed and unmounted if they do not)."""
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    for digest, process in processes.items():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            unmount(mounts / digest.removeprefix("sha256:"))
        if process.stdout is not None:
            process.stdout.close()


def _ready(process: subprocess.Popen[bytes]) -> bool:
    assert process.stdout is not None  # piped
    readable, _, _ = select.select([process.stdout], [], [], READY_SECONDS)
    return bool(readable) and process.stdout.readline().strip() == b"ready"


def _alive(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError:  # ENOTCONN: its process is gone
        return False
    return mounted(path)


def _token(store: LayerStore) -> str:
    return str(store.client.headers.get("authorization", "")).removeprefix("Bearer ")


def _write_private(path: Path, text: str) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)


def _package_path() -> str:
    """Where this worker's packages are, for the mount process's imports."""
    here = Path(__file__).resolve().parents[3]  # .../worker
    paths = [str(here), str(here.parent / "sdk")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(paths)
