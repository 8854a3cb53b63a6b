"""One version of one object in the node's disk cache: a sparse data file plus chunk markers.

- `<key>.data`: the object's bytes at their own offsets, created at the object's full size
  (sparse: ranges not fetched yet are holes that take no disk).
- `<key>.chunks/<start>-<end>`: an empty marker per byte range present in the data file.

A range is fetched once on the node: its writer holds an OFD lock on that range (or on a
run of adjacent ranges fetched with one request) of the data file (`file_locks`), checks
the markers again, writes with `pwrite`, `fdatasync`s, and only then creates the markers,
so a marker never names bytes that a crash (even of the machine) could lose; a crash
before the marker leaves a hole or stray bytes that are fetched again.

Reads map the data file privately (`MAP_PRIVATE`, writable): tensors built on the mapping
are the page cache's pages, copied only if written to (into the process's own memory; the
file never changes). The file is never truncated or rewritten in place, so a mapping never
faults on vanished pages; eviction only unlinks it, and on Linux a mapping keeps its inode
alive: tensors outlive the file's eviction unharmed.

Replicas run as their workspace's uid, and on a root worker the cache is their
workspace's (workspace_caches.py: its folder is that uid's, 0700, and uid 0's for a
snapshot phase run as root): what any of them makes in it is opened to all (folders
0777, files 0666, whatever the maker's umask), so that the next replica of the
workspace, whichever its uid then, reads and fills the same objects.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TypeAlias

from ember_worker.weights.cache.file_locks import lock_range
from ember_worker.weights.origins.range_buffers import RangeBytes

log = logging.getLogger("ember.worker.weights")

SHARED_FILE_MODE = 0o666  # every replica on the node reads and fills the cache's files
SHARED_DIR_MODE = 0o777


def share(path: Path | int, mode: int) -> None:
    """Open a file or folder the cache made to every replica's uid (its maker's to do;
    one another process made is left to it)."""
    with contextlib.suppress(PermissionError, FileNotFoundError):
        if isinstance(path, int):
            os.fchmod(path, mode)
        else:
            os.chmod(path, mode)


def shared_folder(path: Path) -> None:
    """`path` made if missing, open to every replica."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        share(path, SHARED_DIR_MODE)


TEMP_PREFIX = ".tmp-"
# Mark a file used at most this often: a utime per tensor read would be waste.
_TOUCH_EVERY_SECONDS = 1.0

Range = tuple[int, int]
DATA_SUFFIX = ".data"  # an object's data file in the cache
MARKERS_SUFFIX = ".chunks"  # beside each data file: a folder of markers
Identity = tuple[int, int]  # (st_dev, st_ino): which file a path or descriptor is


ViewUse: TypeAlias = Literal["lend", "copy", "check"]


class CachedObject:
    """The data file of one object version; thread-safe. `on_stored(length)` is called
    after every range this instance wrote (the cache's accounting and eviction)."""

    def __init__(self, data_path: Path, size: int, on_stored: Callable[[int], None]) -> None:
        if size < 1:
            raise ValueError(f"an object in the disk cache has bytes, not {size}")
        self.data_path = data_path
        self.markers_dir = data_path.with_suffix(MARKERS_SUFFIX)
        self.size = size
        self._on_stored = on_stored
        self._lock = threading.Lock()
        self._mapping: mmap.mmap | None = None
        self._identity: Identity | None = None
        # Ranges known to be in the mapped file: once written they stay, evicted or not.
        self._present: set[Range] = set()
        # Ranges of this mapping handed out as views, sorted: a tensor owns them now.
        self._lent: list[Range] = []
        # The mapped file, kept open so that it can be mapped afresh even once evicted.
        self._descriptor: int | None = None
        self._touched_at = 0.0

    def view(
        self, start: int, end: int, ranges: Sequence[Range], *, use: ViewUse = "lend"
    ) -> memoryview | None:
        """Bytes [start, end) as a writable view of the mapped file when all of `ranges`
        (the chunks covering them) are present; None when one is not. `use`: "lend", the
        view is handed out (a tensor may write it); "copy", its bytes are copied out;
        "check", only whether it is there matters."""
        with self._lock:
            if use != "check" and self._overlaps_lent(start, end):
                # A tensor given these bytes before may have written them (the mapping is
                # private, so the file is intact): a fresh mapping has the object's bytes.
                self._map_again()
            for _ in range(2):
                mapping, identity = self._mapped()
                missing = [span for span in ranges if span not in self._present]
                if not missing:
                    break
                if not all(self._marker(span).exists() for span in missing):
                    return None
                # Checked after the markers: a file still at the path then had them when
                # they were seen (eviction removes the markers before the file).
                if _identity_at(self.data_path) == identity:
                    self._present.update(missing)
                    break
                self._forget()  # evicted since it was mapped: map the file there now
            else:
                return None
            self._touch()
            if use == "lend" and start < end:
                bisect.insort(self._lent, (start, end))
            return memoryview(mapping)[start:end]

    def _overlaps_lent(self, start: int, end: int) -> bool:
        # Lent ranges never overlap one another (an overlap maps anew), so only the
        # neighbours of `start` in start order can overlap [start, end).
        at = bisect.bisect_left(self._lent, (start, end))
        before = at > 0 and self._lent[at - 1][1] > start
        after = at < len(self._lent) and self._lent[at][0] < end
        return before or after

    def fetch_run(
        self, ranges: Sequence[Range], produce: Callable[[int, int], RangeBytes]
    ) -> Sequence[RangeBytes | None]:
        """Make sure adjacent ranges (each one's end the next one's start) are in the data
        file, each produced at most once on the node: the whole run is locked (everyone
        else waits, then finds the markers), and each stretch of them not on disk yet is
        produced by one `produce(start, end)` call. Per range: None when on disk, else its
        bytes (the disk could not keep them)."""
        if not ranges:
            return []
        if all(self._marker(span).exists() for span in ranges):
            return [None] * len(ranges)
        first, last = ranges[0][0], ranges[-1][1]
        try:
            descriptor = self._locked(first, last)
        except OSError as error:  # a full or read-only disk only slows reads down
            log.warning("weights cache %s unusable, reading around it: %s", self.data_path, error)
            return split_run(produce(first, last), first, ranges)
        results: list[RangeBytes | None] = [None] * len(ranges)
        stored = 0
        try:
            # Checked under the lock: some may have been fetched while we waited for it.
            missing = [at for at, span in enumerate(ranges) if not self._marker(span).exists()]
            for stretch in _adjacent(missing):
                start, end = ranges[stretch[0]][0], ranges[stretch[-1]][1]
                spans = [ranges[at] for at in stretch]
                data = produce(start, end)
                _check_length(data, start, end)
                if self._store(descriptor, data, start, spans):
                    stored += end - start
                    continue
                for at, piece in zip(stretch, split_run(data, start, spans), strict=True):
                    results[at] = piece
        finally:
            os.close(descriptor)  # releases the range lock
        if stored:
            self._touch(force=True)
            self._on_stored(stored)
        return results

    def fetch_part(
        self, start: int, end: int, chunk: Range, produce: Callable[[], RangeBytes]
    ) -> RangeBytes | None:
        """Bytes [start, end) of `chunk` written into the data file for this process alone:
        no marker (the chunk is still missing for others, who fetch it whole), but once
        durable the range is viewable here. None when it is; the bytes when the disk
        could not keep them."""
        try:
            descriptor = self._locked(start, end)
        except OSError as error:
            log.warning("weights cache %s unusable, reading around it: %s", self.data_path, error)
            return produce()
        data: RangeBytes | None = None
        kept = False
        try:
            if not self._marker(chunk).exists():  # else the whole chunk is there already
                data = produce()
                _check_length(data, start, end)
                _write_all(descriptor, data, start)
                os.fdatasync(descriptor)  # viewed only once durable, as chunks are
            with self._lock:
                _, identity = self._mapped()
                kept = _identity_of(descriptor) == identity  # else evicted meanwhile
                if kept:
                    self._present.add((start, end))
        except OSError as error:
            log.warning("weights cache %s could not keep a range: %s", self.data_path, error)
        finally:
            os.close(descriptor)
        if kept and data is not None:
            # Allocated now; counted again, whole, if the chunk comes later, until the
            # cache's rescans correct the total (erring towards evicting early).
            self._on_stored(end - start)
        if kept:
            return None
        return data if data is not None else produce()

    def _store(
        self, descriptor: int, data: RangeBytes, start: int, ranges: Sequence[Range]
    ) -> bool:
        """Write a stretch's bytes, make them durable, then mark its ranges present.
        False when the disk could not keep them."""
        try:
            _write_all(descriptor, data, start)
            os.fdatasync(descriptor)  # the bytes are durable before a marker exists
            shared_folder(self.markers_dir)
            for span in ranges:
                marker = os.open(self._marker(span), os.O_CREAT | os.O_RDONLY, 0o644)
                os.close(marker)
        except OSError as error:
            log.warning("weights cache %s could not keep a chunk: %s", self.data_path, error)
            return False
        with self._lock:
            if _identity_of(descriptor) == self._identity:
                self._present.update(ranges)
        return True

    def missing_bytes(self) -> int:
        """Bytes of the object no marker in the cache names (0: the file holds all of it)."""
        return missing_bytes(self.data_path, self.size)

    def drop_mapping(self) -> None:
        """Forget the mapping (its tensors keep it); the next view maps the file anew."""
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        self._mapping = None
        self._identity = None
        self._present = set()
        self._lent = []
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def _map_again(self) -> None:
        """A fresh private mapping of the file mapped now (the same inode, evicted or not,
        so what is known present stays so); the old one lives on in its tensors."""
        if self._descriptor is None:
            self._forget()
            return
        self._mapping = self._map(self._descriptor)
        self._lent = []

    def _map(self, descriptor: int) -> mmap.mmap:
        return mmap.mmap(
            descriptor, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )

    # -- files ---------------------------------------------------------------------------------

    def _mapped(self) -> tuple[mmap.mmap, Identity]:
        if self._mapping is None or self._identity is None:
            descriptor = self._open(os.O_RDONLY)
            try:
                status = os.fstat(descriptor)
                if status.st_size != self.size:
                    self._discard_damaged((status.st_dev, status.st_ino))
                    raise OSError(
                        f"{self.data_path} has {status.st_size} bytes, not {self.size}: "
                        "damaged, so removed (its chunks are fetched again)"
                    )
                # One mapping of the whole file per reader, sliced per tensor: a mapping per
                # tensor would hold a descriptor each (Python's mmap keeps one open).
                self._mapping = self._map(descriptor)
            except BaseException:
                os.close(descriptor)
                raise
            self._identity = (status.st_dev, status.st_ino)
            self._present = set()
            self._descriptor = descriptor
        return self._mapping, self._identity

    def _discard_damaged(self, identity: Identity) -> None:
        """A data file of the wrong size (cut short, or grown, behind the cache's back)
        can hold none of its chunks where the markers say: it goes, markers first, and
        the next read makes a new one, where fetched chunks go again."""
        if _identity_at(self.data_path) != identity:
            return  # replaced already
        shutil.rmtree(self.markers_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.data_path.unlink()

    def _locked(self, start: int, end: int) -> int:
        """The data file opened for writing with [start, end) locked. A file evicted while we
        waited is not the one at the path any more: then lock the one there now."""
        while True:
            descriptor = self._open(os.O_RDWR)
            try:
                lock_range(descriptor, start, end - start)
                if _identity_of(descriptor) == _identity_at(self.data_path):
                    return descriptor
            except BaseException:
                os.close(descriptor)
                raise
            os.close(descriptor)

    def _open(self, flags: int) -> int:
        while True:
            try:
                return os.open(self.data_path, flags | os.O_CLOEXEC)
            except FileNotFoundError:
                self._create()

    def _create(self) -> None:
        """The data file at full size, appearing at its path all at once (a link), so no one
        ever opens it short."""
        folder = self.data_path.parent
        shared_folder(folder)
        # Markers left by a data file removed behind the cache's back name nothing now.
        shutil.rmtree(self.markers_dir, ignore_errors=True)
        descriptor, temp_name = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX)
        try:
            share(descriptor, SHARED_FILE_MODE)
            os.ftruncate(descriptor, self.size)
            with contextlib.suppress(FileExistsError):  # another process was first
                os.link(temp_name, self.data_path)
        finally:
            os.close(descriptor)
            os.unlink(temp_name)

    def _marker(self, span: Range) -> Path:
        return self.markers_dir / f"{span[0]}-{span[1]}"

    def _touch(self, *, force: bool = False) -> None:
        """Mark the object used, for least-recently-used eviction of whole objects."""
        now = time.monotonic()
        if not force and now - self._touched_at < _TOUCH_EVERY_SECONDS:
            return
        self._touched_at = now
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.data_path)


def missing_bytes(data_path: Path, size: int) -> int:
    """Bytes of [0, size) that no marker beside `data_path` names: `size` when there are
    none. Markers are read by name, so chunk sizes may differ between their writers."""
    try:
        names = os.listdir(data_path.with_suffix(MARKERS_SUFFIX))
    except FileNotFoundError:
        return size
    spans: list[Range] = []
    for name in names:
        first, _, last = name.partition("-")
        if first.isdigit() and last.isdigit():
            spans.append((int(first), min(int(last), size)))
    covered, reached = 0, 0
    for start, end in sorted(spans):
        if end > reached:
            covered += end - max(start, reached)
            reached = end
    return size - covered


def _adjacent(positions: Sequence[int]) -> list[list[int]]:
    """Ascending positions cut into runs of consecutive ones: [1, 2, 4] -> [[1, 2], [4]]."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][-1] == position - 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


def _check_length(data: RangeBytes, start: int, end: int) -> None:
    """Origins deliver exactly the asked bytes; anything else is a bug, never kept."""
    if len(data) != end - start:
        raise ValueError(f"{len(data)} bytes produced for the range [{start}, {end})")


def split_run(data: RangeBytes, base: int, ranges: Sequence[Range]) -> list[RangeBytes]:
    """The pieces of `data` (which starts at offset `base`) that `ranges` cover."""
    _check_length(data, base, ranges[-1][1])
    if len(ranges) == 1:
        return [data]
    view = memoryview(data)
    return [bytes(view[start - base : end - base]) for start, end in ranges]


def _write_all(descriptor: int, data: RangeBytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(descriptor, view, offset)
        view = view[written:]
        offset += written


def _identity_of(descriptor: int) -> Identity:
    status = os.fstat(descriptor)
    return (status.st_dev, status.st_ino)


def _identity_at(path: Path) -> Identity | None:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return (status.st_dev, status.st_ino)
