"""The node-local disk tier: chunks of weights shared by every process on the node.

Layout under `root`:

- `chunks/ab/abcdef…`: one file per chunk, named by its content address (`DiskCache.key`:
  URL, version, range), so a changed object never reuses old chunks. A file's modification
  time is its last use, for LRU eviction.
- `locks/abcdef…`: a lock file per chunk being produced (`flock`), removed when done. Whoever
  holds it is the one process on the node fetching that chunk.
- `size`: the total size of the chunk files, updated under its own `flock`; writers that
  evict do it while holding that lock, so two processes never evict at once.

Writes are atomic (a temporary file in the chunk's folder, then `os.replace`), without fsync:
after a crash a chunk may come back short, and a chunk whose size is not the expected length
is treated as missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ember_worker.weights.origins import ObjectVersion

log = logging.getLogger("ember.worker.weights")

_KEY = re.compile(r"[0-9a-f]{64}")
_TEMP_PREFIX = ".tmp-"
# A temporary file this old belongs to a writer that died; scans remove it.
_STALE_TEMP_SECONDS = 3600.0


@dataclass(frozen=True)
class _ChunkFile:
    key: str
    path: Path
    size: int
    used_at: float


class DiskCache:
    """Chunks on the node's disk within `budget_bytes`, fetched once per node.

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
        self._chunks_dir = root / "chunks"
        self._locks_dir = root / "locks"
        self._size_path = root / "size"

    @staticmethod
    def key(url: str, version: ObjectVersion, start: int, end: int) -> str:
        """The content address of bytes [start, end) of one version of an object."""
        fields = json.dumps([url, version.size, version.tag, start, end])
        return hashlib.sha256(fields.encode()).hexdigest()

    def chunk_path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a cache key: {key!r}")
        return self._chunks_dir / key[:2] / key

    def get(self, key: str, length: int | None = None) -> bytes | None:
        """The cached chunk, or None. With `length`, a chunk of any other size is missing."""
        path = self.chunk_path(key)
        try:
            with open(path, "rb") as file:
                if length is not None and os.fstat(file.fileno()).st_size != length:
                    return None
                data = file.read()
        except FileNotFoundError:
            return None
        except OSError as error:  # an unreadable chunk is a missing one
            log.warning("weights cache %s could not read a chunk: %s", self.root, error)
            return None
        if length is not None and len(data) != length:
            return None
        # Mark it used for LRU; it may have been evicted since we opened it, which is fine.
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
        return data

    def fetch(self, key: str, produce: Callable[[], bytes], length: int | None = None) -> bytes:
        """The cached chunk; if missing, `produce()` runs once on the whole node (every other
        thread or process asking for the same key waits, then reads the cached result)."""
        data = self.get(key, length)
        if data is not None:
            return data
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self._key_lock(key))
            except OSError as error:
                # A full or read-only disk must not fail the read, only slow it down.
                log.warning("weights cache %s unusable, reading around it: %s", self.root, error)
                return produce()
            data = self.get(key, length)
            if data is not None:
                return data
            data = produce()
            try:
                self._store(key, data)
            except OSError as error:
                log.warning("weights cache %s could not keep a chunk: %s", self.root, error)
        return data

    def usage(self) -> int:
        """Bytes of chunk files on disk now (a full scan)."""
        return sum(chunk.size for chunk in self._scan())

    # -- storing and evicting ------------------------------------------------------------------

    def _store(self, key: str, data: bytes) -> None:
        """Write a chunk atomically, then evict until the cache fits. Called with the key's
        lock held, so no other process evicts this chunk before we are done."""
        if len(data) > self.budget_bytes:
            return  # it could never fit: leave it to the memory tier
        path = self.chunk_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
            replaced = _size_or_zero(path)  # a short chunk left by a crash
            os.replace(temp_name, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
            raise
        self._account(key, len(data) - replaced)

    def _account(self, written_key: str, added: int) -> None:
        with self._size_file() as size_fd:
            total = _read_total(size_fd)
            self._writes_since_scan += 1
            chunks: list[_ChunkFile] | None = None
            if total is None or self._writes_since_scan >= self._rescan_every:
                chunks = self._scan()
                total = sum(chunk.size for chunk in chunks)
                self._writes_since_scan = 0
            else:
                total += added
            if total > self.budget_bytes:
                if chunks is None:
                    chunks = self._scan()
                    total = sum(chunk.size for chunk in chunks)
                total = self._evict(chunks, total, written_key)
            _write_total(size_fd, total)

    def _evict(self, chunks: list[_ChunkFile], total: int, keep: str) -> int:
        """Remove least recently used chunks until `total` fits; returns the new total.
        Skips `keep` and every chunk whose lock another thread or process holds."""
        for chunk in sorted(chunks, key=lambda chunk: chunk.used_at):
            if total <= self.budget_bytes:
                break
            if chunk.key == keep:
                continue
            with self._try_key_lock(chunk.key) as locked:
                if not locked:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(chunk.path)
                # Gone either way: removed now, or by someone else since the scan.
                total -= chunk.size
        return max(total, 0)

    def _scan(self) -> list[_ChunkFile]:
        chunks: list[_ChunkFile] = []
        now = time.time()
        try:
            folders = list(os.scandir(self._chunks_dir))
        except FileNotFoundError:
            return chunks
        for folder in folders:
            if not folder.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(folder.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    status = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # evicted meanwhile
                if entry.name.startswith(_TEMP_PREFIX):
                    if now - status.st_mtime > _STALE_TEMP_SECONDS:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                    continue
                if _KEY.fullmatch(entry.name):
                    chunks.append(
                        _ChunkFile(entry.name, Path(entry.path), status.st_size, status.st_mtime)
                    )
        return chunks

    # -- locks ---------------------------------------------------------------------------------

    @contextmanager
    def _size_file(self) -> Iterator[int]:
        """The size file, locked. Never removed, so its lock needs no identity check."""
        self.root.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self._size_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield descriptor
        finally:
            os.close(descriptor)

    @contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        descriptor = None
        while descriptor is None:  # a blocking attempt returns only once it holds the lock
            descriptor = self._lock_key(key, blocking=True)
        try:
            yield
        finally:
            self._unlock_key(key, descriptor)

    @contextmanager
    def _try_key_lock(self, key: str) -> Iterator[bool]:
        descriptor = self._lock_key(key, blocking=False)
        try:
            yield descriptor is not None
        finally:
            if descriptor is not None:
                self._unlock_key(key, descriptor)

    def _lock_key(self, key: str, *, blocking: bool) -> int | None:
        """Lock the key's lock file; None if `blocking` is off and someone else holds it.

        Lock files are removed by their holder on release, so a lock may be won on a file
        that is no longer the one at the path; then it is worthless and we try again.
        """
        path = self._locks_dir / key
        flags = fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB
        while True:
            self._locks_dir.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(descriptor, flags)
            except BlockingIOError:
                os.close(descriptor)
                return None
            except BaseException:
                os.close(descriptor)
                raise
            if _is_file_at(descriptor, path):
                return descriptor
            os.close(descriptor)
            if not blocking:
                return None

    def _unlock_key(self, key: str, descriptor: int) -> None:
        # Remove while still holding the lock: whoever waits on this file will notice.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._locks_dir / key)
        os.close(descriptor)


def _is_file_at(descriptor: int, path: Path) -> bool:
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_total(descriptor: int) -> int | None:
    """The recorded total, or None when there is none yet or it is unreadable."""
    text = os.pread(descriptor, 64, 0).strip()
    return int(text) if text.isdigit() else None


def _write_total(descriptor: int, total: int) -> None:
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, str(total).encode(), 0)
