"""A node's image roots: the root file system a replica of an image-based endpoint runs
on, one per image, shared by every replica of that image on the node and never written
(the sandbox mounts it read-only).

`ImageRoots` is what the replica launcher asks for; `ExtractedImageRoots` makes a root
by unpacking the image's layers whole (eager), into a content-addressed cache under the
node's work dir: `roots/<image digest hex>/`, its size and last use in
`roots/<hex>.json` beside it. A lazily loaded file system (FUSE over the
node's tiered cache) is to implement the same interface: `root_for` answers a folder
that holds the image's files, the mount points of `MOUNT_POINTS` and the image's
working folder included (see `prepare_mount_points`).

`present` and `remove` are what root_collection.py collects with: the roots this node
holds, and one removed (never while a replica uses it: the collector checks, holding
the image's lock, which `root_for` holds while it makes a root).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from stat import S_ISLNK, S_ISREG
from typing import Any

from ember.images.image import Image
from ember_worker.images.layer_store import LayerStore, LayerStoreError
from ember_worker.images.oci_layers import apply_layer

ROOTS_DIR = "roots"
# Files of /etc that the node's copies are bind-mounted over (sandboxes.py): they must
# exist in the image for that (a mount point of a file is a file).
MOUNT_POINTS = ("etc/resolv.conf", "etc/hosts")
# Where an image's python3.X may be: Debian's and the official Python images'.
PYTHON_DIRS = ("usr/local/bin", "usr/bin", "bin")


class ImageRootError(Exception):
    """The image cannot be a replica's root here: not built, not fetched, no Python."""


@dataclass(frozen=True)
class NodeRoot:
    """A root of an image this node holds: what it costs the node's disk (an extracted
    tree; 0 for a mount, whose bytes are in the image cache with its own budget) and
    when a replica last asked for it (0: unknown, e.g. made before a restart)."""

    digest: str
    how: str  # "extracted" or "lazy"
    size: int = 0
    used_at: float = 0.0


@dataclass(frozen=True)
class ImageConfig:
    """What an image says of the replicas that run on it."""

    digest: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"


def runtime_python() -> str:
    """The interpreter's name an image must have: the worker's version (Ember's compiled
    dependencies, mounted into the replica, are built for it)."""
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def python_in(root: Path) -> str | None:
    """The path inside the image of its interpreter of the worker's Python version."""
    name = runtime_python()
    for folder in PYTHON_DIRS:
        if os.path.lexists(root / folder / name):
            return f"/{folder}/{name}"
    return None


def prepare_mount_points(root: Path, config: ImageConfig) -> None:
    """The files and folders a replica's sandbox mounts over or starts in, made in `root`
    where the image lacks them (a link where a file should be is replaced: the mount
    would follow it). Every path in the image is the tenant's: each is walked from
    `root` by descriptor and no link in it is followed (a link would lead root to a
    node folder); /etc must be a folder, a working folder through a link is left to
    the sandbox, which resolves it inside the image."""
    at = os.open(root, _FOLDER)
    try:
        for name in MOUNT_POINTS:
            *folders, leaf = PurePosixPath(name).parts
            parent = _walk(at, folders)
            if parent is None:
                raise ImageRootError(f"the image's /{'/'.join(folders)} is not a folder")
            try:
                _mount_file(parent, leaf)
            finally:
                os.close(parent)
        workdir = _walk(at, PurePosixPath(config.workdir).relative_to("/").parts)
        if workdir is not None:
            os.close(workdir)
    finally:
        os.close(at)


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(at: int, names: Sequence[str]) -> int | None:
    """A descriptor of the folder `names` leads to from `at`, those missing made (0755);
    None where one of them is a link or not a folder."""
    fd = os.dup(at)
    for name in names:
        if name in ("", ".", ".."):
            os.close(fd)
            return None
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=fd)
        try:
            step = os.open(name, _FOLDER, dir_fd=fd)
        except OSError:  # a link (ELOOP) or not a folder
            os.close(fd)
            return None
        os.close(fd)
        fd = step
    return fd


def _mount_file(folder: int, name: str) -> None:
    """An empty file `name` in `folder` unless a regular file is there (a link goes)."""
    try:
        if S_ISLNK(os.lstat(name, dir_fd=folder).st_mode):
            os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(name, flags, 0o644, dir_fd=folder))
    except FileExistsError:
        pass


class ImageRoots(ABC):
    """A node's roots of images, by image (blocking work runs in threads)."""

    def __init__(self, store: LayerStore) -> None:
        self.store = store
        self._configs: dict[str, ImageConfig] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # by image: held to make or remove a root

    def lock_for(self, digest: str) -> asyncio.Lock:
        return self._locks.setdefault(digest, asyncio.Lock())

    async def record(self, image: Image) -> dict[str, Any]:
        """The image's record in the control plane's store (its layers, env, workdir)."""
        try:
            record = await asyncio.to_thread(self.store.record, image.digest)
        except LayerStoreError as exc:
            raise ImageRootError(f"image {image.digest[7:19]}: {exc}") from None
        if record is None:
            raise ImageRootError(
                f"image {image.digest[7:19]} is not built (`ember deploy` builds it)"
            )
        return record

    async def config_for(self, image: Image) -> ImageConfig:
        """The image's env and working folder (its record's, read once)."""
        known = self._configs.get(image.digest)
        if known is None:
            record = await self.record(image)
            known = ImageConfig(
                image.digest, dict(record.get("env") or {}), str(record.get("workdir") or "/")
            )
            self._configs[image.digest] = known
        return known

    def describe(self, digest: str) -> str:
        """How this node made the root of image `digest`, for a replica's start report."""
        return "extracted"

    @abstractmethod
    async def root_for(self, image: Image) -> Path:
        """The image's root file system on this node, ready to be bind-mounted read-only
        (made on first use; ImageRootError if it cannot be)."""

    def present(self) -> list[NodeRoot]:
        """The roots this node holds (blocking)."""
        return []

    def remove(self, digest: str) -> None:
        """Remove this node's copies of image `digest` (blocking; the caller holds its
        lock and has seen that no replica uses it)."""
        self._configs.pop(digest, None)


class ExtractedImageRoots(ImageRoots):
    """Roots unpacked whole from the image's layer tars (fetched through the control
    plane), once per image per node; concurrent replicas of one image wait for one
    extraction."""

    def __init__(self, store: LayerStore, folder: Path) -> None:
        super().__init__(store)
        self.folder = folder / ROOTS_DIR

    def path_of(self, image: Image) -> Path:
        return self.folder / image.digest.removeprefix("sha256:")

    def _sidecar(self, hex_digest: str) -> Path:
        return self.folder / f"{hex_digest}.json"

    async def root_for(self, image: Image) -> Path:
        root = self.path_of(image)
        async with self.lock_for(image.digest):
            if not root.is_dir():
                record = await self.record(image)
                config = await self.config_for(image)
                await asyncio.to_thread(self._extract, record, config, root)
            _touch(self._sidecar(root.name))  # used now: the last to go past the budget
        if python_in(root) is None:
            raise ImageRootError(
                f"image {image.digest[7:19]} has no {runtime_python()} in "
                f"{', '.join('/' + d for d in PYTHON_DIRS)}: replicas run Ember's runtime "
                f"with the image's Python, which must be the worker's version "
                "(docs/images.md)"
            )
        return root

    def _extract(self, record: dict[str, Any], config: ImageConfig, root: Path) -> None:
        """Every layer applied in order into a new folder, renamed into place when whole
        (a crash leaves a partial folder, removed at the next start)."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.folder / f".partial-{root.name[:12]}-{secrets.token_hex(4)}"
        tree = partial / "root"
        try:
            tree.mkdir(mode=0o755, parents=True)
            for layer in record["layers"]:
                with tempfile.NamedTemporaryFile(dir=partial, suffix=".tar") as archive:
                    try:
                        self.store.fetch_tar(layer["sha256"], Path(archive.name))
                    except LayerStoreError as exc:
                        raise ImageRootError(f"layer {layer['digest'][7:19]}: {exc}") from None
                    apply_layer(Path(archive.name), tree)
            os.chmod(tree, 0o755)
            prepare_mount_points(tree, config)
            # What it holds, about: its layer tars' sizes (a later layer's copy of a file
            # counts twice; a whiteout's file once).
            size = sum(int(layer.get("size") or 0) for layer in record["layers"])
            self._sidecar(root.name).write_text(json.dumps({"size": size}))
            os.rename(tree, root)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def present(self) -> list[NodeRoot]:
        if not self.folder.is_dir():
            return []
        roots = []
        for path in self.folder.iterdir():
            if path.name.startswith(".") or not path.is_dir() or path.is_symlink():
                continue
            sidecar = self._sidecar(path.name)
            try:
                size = int(json.loads(sidecar.read_text())["size"])
                used_at = sidecar.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError):
                size, used_at = _tree_size(path), 0.0  # made by an older worker
            roots.append(NodeRoot("sha256:" + path.name, "extracted", size, used_at))
        return roots

    def remove(self, digest: str) -> None:
        """The tree moved aside at once (a start never finds half of it), then removed."""
        super().remove(digest)
        hex_digest = digest.removeprefix("sha256:")
        self._sidecar(hex_digest).unlink(missing_ok=True)
        root = self.folder / hex_digest
        if not os.path.lexists(root):
            return
        aside = self.folder / f".removed-{hex_digest[:12]}-{secrets.token_hex(4)}"
        os.rename(root, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def clean_partial(self) -> None:
        """What an extraction cut short left (at the worker's start; blocking)."""
        if self.folder.is_dir():
            for pattern in (".partial-*", ".removed-*"):
                for path in self.folder.glob(pattern):
                    shutil.rmtree(path, ignore_errors=True)


def _touch(path: Path) -> None:
    """Mark as used now (a root extracted by an older worker has no sidecar: none)."""
    if path.exists():
        now = time.time()
        os.utime(path, (now, now))


def _tree_size(root: Path) -> int:
    """Bytes of the regular files under `root` (links not followed)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                info = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if S_ISREG(info.st_mode):
                total += info.st_size
    return total
