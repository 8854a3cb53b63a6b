"""The node's weights caches, one per workspace, and the node's disk budget over them all.

Replicas fill the disk tier themselves (disk_cache.py), as their workspace's uid. A
cache every replica may write would let one tenant poison the weights another reads, so
each workspace has a folder of its own, `<weights dir>/uid-<uid>/` (its uid's, 0700
and an ACL entry for uid 0, in root's 0711 weights dir), mounted into its replicas'
sandboxes only, at the same path on every node (`/ember/worker/weights/uid-<uid>`; a
workspace's uid is the same on every node): an image that maps weights from it
restores on any node and into any replica of that workspace. A worker that is not root
keeps the one shared cache at the folder's top (its replicas all run as its own user).

`--weights-cache-gb` is the node's total. A workspace's replicas keep its cache within
the whole of it (the budget they are given); the agent (`NodeWeights.enforce`, every
heartbeat) brings the sum of all caches back within it, evicting the least recently used
objects of the workspaces holding more than an equal share of the budget, so that one
tenant filling the disk evicts its own weights before another's.

The agent runs as root inside folders a tenant controls: it never follows a link there
(every file is opened relative to its folder's descriptor, O_NOFOLLOW, regular files only),
and it never writes into them (a fill for a restore runs as the workspace's uid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ember_worker.processes import file_grants
from ember_worker.weights.cache.disk_cache import objects_dir
from ember_worker.weights.cache.disk_object import DATA_SUFFIX, MARKERS_SUFFIX
from ember_worker.weights.cache.file_locks import try_lock_range

PREFIX = "uid-"
URL_SUFFIX = ".url"
ROOT_MODE = 0o711  # replicas pass through to their workspace's folder, never list it
MAX_URL_BYTES = 16 * 1024
# Two replicas of a workspace starting at once prepare its folder in two threads: one
# would take the other's new folder, not yet chowned, for another owner's and remove it.
_PREPARING = threading.Lock()


def workspace_dir(root: Path, uid: int) -> Path:
    """The cache folder of the workspace whose replicas run as `uid`."""
    return root / f"{PREFIX}{uid}"


def uid_of(path: str | Path) -> int | None:
    """The uid whose workspace cache holds `path` (a data file, as an image names it),
    or None if it lies in none of this node's (or another node's) workspace folders."""
    parts = Path(path).parts
    for index, part in enumerate(parts[:-2]):
        number = part.removeprefix(PREFIX)
        if part.startswith(PREFIX) and number.isdigit() and parts[index + 1] == "objects":
            return int(number)
    return None


def prepare_root(root: Path) -> None:
    """The weights dir as root's, 0711, holding workspace folders only: a shared cache
    an earlier worker left at its top goes (any replica could write it, so none of it
    can be trusted; blocking)."""
    root.mkdir(parents=True, exist_ok=True)
    os.chown(root, 0, 0)
    os.chmod(root, ROOT_MODE)
    for entry in os.scandir(root):
        if entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def prepare_workspace(root: Path, uid: int, gid: int) -> Path:
    """The workspace's cache folder, its uid's and 0700 (made if missing; one of another
    owner is replaced: blocking)."""
    with _PREPARING:
        return _prepare_workspace(root, uid, gid)


def _prepare_workspace(root: Path, uid: int, gid: int) -> Path:
    folder = workspace_dir(root, uid)
    try:
        status = os.lstat(folder)
    except FileNotFoundError:
        status = None
    if status is not None and (not stat.S_ISDIR(status.st_mode) or status.st_uid != uid):
        if stat.S_ISDIR(status.st_mode):
            shutil.rmtree(folder, ignore_errors=True)
        else:
            os.unlink(folder)
        status = None
    if status is None:
        folder.mkdir(mode=0o700)
        os.chown(folder, uid, gid)
    os.chmod(folder, 0o700)
    # A replica of this workspace that runs its snapshot phase as uid 0 without
    # capabilities (where CRIU lacks CAP_SYS_RESOURCE) fills it too; no other uid 0
    # process but root's sees the folder (the sandbox mounts it into this workspace's only).
    file_grants.grant(folder, 0, file_grants.RWX)
    file_grants.grant_passage(folder, uid)  # through the folders above (a 0700 state dir)
    return folder


@dataclass(frozen=True)
class _Held:
    folder: Path  # the cache's objects folder
    name: str  # the data file's name in it
    size: int  # allocated on disk
    used_at: float


def _open_folder(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def _read_small(name: str, dir_fd: int) -> str | None:
    """A small regular file's text, never following a link nor blocking on a FIFO."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_URL_BYTES).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


class NodeWeights:
    """Every weights cache on this node (the shared one at the top of `root` and each
    workspace's), seen and kept within `budget_bytes` by the agent."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes

    def caches(self) -> list[Path]:
        """The folders of the caches: the top one (a worker that is not root) and the
        workspaces'."""
        found = [self.root]
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                if entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False):
                    found.append(Path(entry.path))
        return found

    def _held(self) -> Iterator[tuple[Path, list[_Held]]]:
        for cache in self.caches():
            folder = objects_dir(cache)
            fd = _open_folder(folder)
            if fd is None:
                continue
            held = []
            try:
                for name in os.listdir(fd):
                    if not name.endswith(DATA_SUFFIX):
                        continue
                    with contextlib.suppress(OSError):
                        status = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISREG(status.st_mode):
                            held.append(
                                _Held(folder, name, status.st_blocks * 512, status.st_mtime)
                            )
            finally:
                os.close(fd)
            yield cache, held

    def usage(self) -> int:
        """Bytes every cache's data files take on disk (a full scan)."""
        return sum(entry.size for _, held in self._held() for entry in held)

    def room_for(self, size: int) -> bool:
        """Whether `size` more bytes fit in the node's budget, evicting nothing."""
        return self.usage() + size <= self.budget_bytes

    def holdings(self) -> dict[str, int]:
        """Bytes on disk by object URL, every cache and version together (what the
        scheduler weighs): the URL noted beside each data file."""
        found: dict[str, int] = {}
        for _, held in self._held():
            for entry in held:
                fd = _open_folder(entry.folder)
                if fd is None:
                    continue
                try:
                    url = _read_small(entry.name.removesuffix(DATA_SUFFIX) + URL_SUFFIX, fd)
                finally:
                    os.close(fd)
                if url and entry.size:
                    found[url] = found.get(url, 0) + entry.size
        return found

    def enforce(self) -> int:
        """Evict until every cache together fits the budget, from the workspaces above an
        equal share of it first, least recently used first; the bytes freed."""
        by_cache = {cache: held for cache, held in self._held()}
        usage = {cache: sum(e.size for e in held) for cache, held in by_cache.items()}
        total = sum(usage.values())
        freed = 0
        if total <= self.budget_bytes:
            return 0
        holders = [cache for cache, used in usage.items() if used]
        share = self.budget_bytes // max(len(holders), 1)
        queues = {cache: sorted(held, key=lambda e: e.used_at) for cache, held in by_cache.items()}
        while total > self.budget_bytes:
            candidates = [c for c in holders if queues[c]]
            if not candidates:
                break
            # The cache most over its share gives up its least recently used object.
            cache = max(candidates, key=lambda c: usage[c] - share)
            entry = queues[cache].pop(0)
            if _remove(entry):
                usage[cache] -= entry.size
                total -= entry.size
                freed += entry.size
        return freed


def _remove(entry: _Held) -> bool:
    """Remove one object (its markers, its data file, its URL) unless someone writes it;
    relative to its folder's descriptor, following no link."""
    folder = _open_folder(entry.folder)
    if folder is None:
        return False
    try:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(entry.name, flags, dir_fd=folder)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or not try_lock_range(fd, 0, 0):
                return False
            stem = entry.name.removesuffix(DATA_SUFFIX)
            markers = stem + MARKERS_SUFFIX
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.stat(markers, dir_fd=folder, follow_symlinks=False).st_mode):
                    shutil.rmtree(markers, dir_fd=folder, ignore_errors=True)
                else:
                    os.unlink(markers, dir_fd=folder)
            os.unlink(entry.name, dir_fd=folder)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stem + URL_SUFFIX, dir_fd=folder)
            return True
        finally:
            os.close(fd)
    finally:
        os.close(folder)
