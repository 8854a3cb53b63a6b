"""The node-local disk tier: objects of weights shared by every process on the node.

Layout under `root`:

- `objects/<key>.data` and `objects/<key>.chunks/`: one sparse data file per object version
  and its markers of present ranges (`disk_object.CachedObject`). The key is a digest of the
  URL and the object's version (`DiskCache.key`), so a changed object is another file and
  versions never mix. A data file's modification time is its last use.
- `objects/<key>.url`: the object's URL, for `holdings` (what the node reports to the
  control plane, whose scheduler prefers nodes that hold an endpoint's weights).
- `size`: the bytes the data files take on disk, updated under its own `flock`; writers that
  evict do it while holding that lock, so two processes never evict at once.

Eviction removes whole objects, least recently used first, until the allocated bytes of the
data files (`st_blocks`: present ranges only, holes are free) fit the budget. It skips a file
whose ranges someone is writing (it must win a lock on the whole file) and removes the
markers before the file. Files mapped by a process may go: on Linux an unlinked file lives on
until its last mapping is gone, so tensors built on it stay valid (their disk space is freed
only then).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ember_worker.weights.cache.disk_object import (
    DATA_SUFFIX,
    MARKERS_SUFFIX,
    SHARED_FILE_MODE,
    TEMP_PREFIX,
    CachedObject,
    share,
    shared_folder,
)
from ember_worker.weights.cache.file_locks import try_lock_range
from ember_worker.weights.origins.origin import ObjectVersion

log = logging.getLogger("ember.worker.weights")

_KEY = re.compile(r"[0-9a-f]{64}")
_URL_SUFFIX = ".url"
# A temporary file this old belongs to a writer that died; scans remove it.
_STALE_TEMP_SECONDS = 3600.0


@dataclass(frozen=True)
class _ObjectFile:
    key: str
    path: Path
    size: int  # allocated on disk
    used_at: float


def objects_dir(root: Path) -> Path:
    """Where the cache at `root` keeps its objects' data files."""
    return root / "objects"


class DiskCache:
    """Objects on the node's disk within `budget_bytes`, each range fetched once per node.

    The recorded total is rescanned every `rescan_every` writes by this instance (and
    whenever eviction is needed), which corrects drift from crashed writers or files
    removed behind the cache's back.
    """

    def __init__(self, root: Path, budget_bytes: int, *, rescan_every: int = 256) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, not {budget_bytes}")
        self.root = root
        self.budget_bytes = budget_bytes
        self._rescan_every = max(1, rescan_every)
        self._writes_since_scan = 0
        self._objects_dir = objects_dir(root)
        self._size_path = root / "size"

    @staticmethod
    def key(url: str, version: ObjectVersion) -> str:
        """The address of one version of an object."""
        fields = json.dumps([url, version.size, version.tag])
        return hashlib.sha256(fields.encode()).hexdigest()

    def data_path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self._objects_dir / (key + DATA_SUFFIX)

    def open(self, url: str, version: ObjectVersion) -> CachedObject | None:
        """The object's place in the cache; None when it cannot have one (empty, larger than
        the whole budget, or an unusable cache folder): read it around the cache."""
        if not 0 < version.size <= self.budget_bytes:
            return None
        try:
            shared_folder(self._objects_dir)
        except OSError as error:
            log.warning("weights cache %s unusable, reading around it: %s", self.root, error)
            return None
        key = self.key(url, version)
        data_path = self.data_path(key)
        _note_url(data_path.with_suffix(_URL_SUFFIX), url)
        return CachedObject(data_path, version.size, partial(self._stored, key))

    def usage(self) -> int:
        """Bytes the data files take on disk now (a full scan)."""
        return sum(entry.size for entry in self._scan())

    def room_for(self, size: int) -> bool:
        """Whether `size` more bytes fit beside what the cache holds, so that storing them
        would evict nothing (a full scan)."""
        return self.usage() + size <= self.budget_bytes

    def holdings(self) -> dict[str, int]:
        """Bytes on disk by object URL, every version together (a full scan). An object
        whose URL was not noted (its writer died first) is left out."""
        held: dict[str, int] = {}
        for entry in self._scan():
            try:
                url = entry.path.with_suffix(_URL_SUFFIX).read_text()
            except (FileNotFoundError, UnicodeDecodeError):
                continue
            if entry.size:
                held[url] = held.get(url, 0) + entry.size
        return held

    # -- accounting and evicting ---------------------------------------------------------------

    def _stored(self, key: str, added: int) -> None:
        try:
            self._account(key, added)
        except OSError as error:
            log.warning("weights cache %s could not account for a chunk: %s", self.root, error)

    def _account(self, written_key: str, added: int) -> None:
        with self._size_file() as size_fd:
            total = _read_total(size_fd)
            self._writes_since_scan += 1
            entries: list[_ObjectFile] | None = None
            if total is None or self._writes_since_scan >= self._rescan_every:
                entries = self._scan()
                total = sum(entry.size for entry in entries)
                self._writes_since_scan = 0
            else:
                total += added
            if total > self.budget_bytes:
                if entries is None:
                    entries = self._scan()
                    total = sum(entry.size for entry in entries)
                total = self._evict(entries, total, written_key)
            _write_total(size_fd, total)

    def _evict(self, entries: list[_ObjectFile], total: int, keep: str) -> int:
        """Remove least recently used objects until `total` fits; returns the new total.
        Skips `keep` and every object some thread or process is writing."""
        for entry in sorted(entries, key=lambda entry: entry.used_at):
            if total <= self.budget_bytes:
                break
            if entry.key == keep:
                continue
            if _remove_object(entry.path):
                total -= entry.size
        return max(total, 0)

    def _scan(self) -> list[_ObjectFile]:
        entries: list[_ObjectFile] = []
        now = time.time()
        try:
            listed = list(os.scandir(self._objects_dir))
        except FileNotFoundError:
            return entries
        for item in listed:
            try:
                status = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted meanwhile
            if item.name.startswith(TEMP_PREFIX):
                if now - status.st_mtime > _STALE_TEMP_SECONDS:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.path)
                continue
            key = item.name.removesuffix(DATA_SUFFIX)
            if item.name.endswith(DATA_SUFFIX) and _KEY.fullmatch(key):
                entries.append(
                    _ObjectFile(key, Path(item.path), status.st_blocks * 512, status.st_mtime)
                )
        return entries

    @contextmanager
    def _size_file(self) -> Iterator[int]:
        """The size file, locked. Never removed, so its lock needs no identity check."""
        self.root.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self._size_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        share(descriptor, SHARED_FILE_MODE)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield descriptor
        finally:
            os.close(descriptor)


def _remove_object(path: Path) -> bool:
    """Remove one object's markers, then its data file, unless someone is writing to it.
    True when it is gone (removed now, or by someone else since the scan)."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        if not try_lock_range(descriptor, 0, 0):
            return False
        held = os.fstat(descriptor)
        try:
            at_path = os.stat(path)
        except FileNotFoundError:
            return True
        if (held.st_dev, held.st_ino) != (at_path.st_dev, at_path.st_ino):
            return False  # replaced since the scan: a new object, not the one measured
        # Markers first: a reader that still sees one also sees this file at the path.
        shutil.rmtree(path.with_suffix(MARKERS_SUFFIX), ignore_errors=True)
        os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.with_suffix(_URL_SUFFIX))
        return True
    finally:
        os.close(descriptor)  # releases the lock


def _note_url(path: Path, url: str) -> None:
    """Write the object's URL beside its data file, once (renamed into place, so a reader
    never sees half of it)."""
    if path.exists():
        return
    try:
        descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX)
        share(descriptor, 0o644)  # read by every replica's scan
        with os.fdopen(descriptor, "w") as out:
            out.write(url)
        os.replace(temp_name, path)
    except OSError as error:  # only placement hints are lost
        log.warning("weights cache could not note the URL of %s: %s", path.name, error)


def _read_total(descriptor: int) -> int | None:
    """The recorded total, or None when there is none yet or it is unreadable."""
    text = os.pread(descriptor, 64, 0).strip()
    return int(text) if text.isdigit() else None


def _write_total(descriptor: int, total: int) -> None:
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, str(total).encode(), 0)
