"""A reader's object in the node's disk tier: its data file, opened on first need for the
reader's version; reads served as views of that file's private mapping, without a copy;
and which of its chunks this reader has already counted and reported."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.cache.disk_object import CachedObject, ViewUse
from ember_worker.weights.reading.chunk_grid import ChunkGrid
from ember_worker.weights.reading.origin_reads import OriginReads
from ember_worker.weights.reading.read_counts import ReadCounts

log = logging.getLogger("ember.worker.weights")


class DiskPlace:
    def __init__(
        self,
        disk: DiskCache | None,
        origin: OriginReads,
        grid: ChunkGrid,
        counts: ReadCounts,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        self._disk = disk
        self._origin = origin
        self._grid = grid
        self._counts = counts
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._cached: CachedObject | None = None
        self._cached_opened = False
        self._seen: set[int] = set()  # chunks of the disk tier already counted and reported

    @property
    def tier(self) -> DiskCache | None:
        return self._disk

    def file(self) -> CachedObject | None:
        """This version's place in the disk tier, or None when there is none."""
        with self._lock:
            opened = self._cached_opened
        if not opened:
            version = self._origin.version
            cached = None if self._disk is None else self._disk.open(self._origin.url, version)
            with self._lock:
                if not self._cached_opened:
                    self._cached, self._cached_opened = cached, True
        return self._cached

    def move(self, disk: DiskCache) -> None:
        """Use `disk` as the disk tier from now on (`ObjectReader.move_disk_tier`)."""
        with self._lock:
            old, self._disk = self._cached, disk
            self._cached, self._cached_opened = None, False
        if old is not None:
            old.drop_mapping()

    def drop_mapping(self) -> None:
        """Let go of the file's mapping (tensors built on it keep it as long as they live)."""
        if self._cached is not None:
            self._cached.drop_mapping()

    def mapped(
        self,
        start: int,
        end: int,
        span: range,
        *,
        count: bool,
        ranges: Sequence[tuple[int, int]] | None = None,
        use: ViewUse = "lend",
    ) -> memoryview | None:
        """The range as a view of the disk tier's mapping, if all its chunks (or `ranges`,
        in their place) are there."""
        cached = self.file()
        if cached is None or not span:
            return None
        if ranges is None:
            ranges = [self._grid.bounds(index) for index in span]
        try:
            view = cached.view(start, end, ranges, use=use)
        except OSError as error:
            log.warning(
                "weights cache unusable for %s, reading around it: %s", self._origin.url, error
            )
            return None
        if view is not None and count:
            for index in span:
                self.saw(index, fetched=False, lookup=True)
        return view

    def holds(self, index: int) -> bool:
        """Whether the disk tier holds chunk `index` whole."""
        cached = self.file()
        if cached is None:
            return False
        low, high = self._grid.bounds(index)
        try:
            return cached.view(low, high, [(low, high)], use="check") is not None
        except OSError:  # an unusable cache holds nothing
            return False

    def saw(self, index: int, *, fetched: bool, lookup: bool) -> None:
        """Count a chunk found in (or just put into) the disk tier; report it the first time."""
        if lookup:
            self._counts.add("chunks")
        with self._lock:
            first = index not in self._seen
            self._seen.add(index)
        if not first:
            if lookup:
                self._counts.add("memory_hits")  # the page cache, via the mapping
            return
        if not fetched:
            self._counts.add("disk_hits")
        if self._on_progress is not None:
            start, end = self._grid.bounds(index)
            self._on_progress(end - start)
