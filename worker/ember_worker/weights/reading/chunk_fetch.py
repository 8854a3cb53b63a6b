"""A reader's threads and the chunks they bring in: each chunk fetched once however many
reads want it at the same time (later ones join the fetch under way), adjacent ones asked
for with one request, into the disk tier when there is one (from the origin once per node)
or else into the reader's memory; and the background work of `prefetch`.

Fetches are registered and submitted under one lock, which `close()` takes too: a closed
reader starts nothing, and never leaves a fetch waiting for a pool that was shut down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from ember.errors import WeightsError
from ember_worker.weights.cache.disk_object import split_run
from ember_worker.weights.origins.range_buffers import RangeBytes
from ember_worker.weights.reading.chunk_grid import ChunkGrid
from ember_worker.weights.reading.chunk_memory import ChunkMemory
from ember_worker.weights.reading.disk_place import DiskPlace
from ember_worker.weights.reading.origin_reads import OriginReads
from ember_worker.weights.reading.read_counts import ReadCounts

# A chunk's result: None when it is in the disk tier, else its bytes.
ChunkFuture = Future[RangeBytes | None]


def _settle(run: list[tuple[int, ChunkFuture]], task: Future[None]) -> None:
    """After a run's task: chunks it left without a result share its failure (or, when the
    pool was shut down before it ran, are cancelled), so no reader waits forever."""
    for _, future in run:
        if future.done():
            continue
        if task.cancelled():
            future.cancel()
        else:
            error = task.exception()
            future.set_exception(error if error is not None else RuntimeError("chunk not read"))


def _completed(data: RangeBytes | None) -> ChunkFuture:
    future: ChunkFuture = Future()
    future.set_result(data)
    return future


class ChunkFetcher:
    def __init__(
        self,
        concurrency: int,
        origin: OriginReads,
        grid: ChunkGrid,
        memory: ChunkMemory,
        disk: DiskPlace,
        counts: ReadCounts,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        self._concurrency = concurrency
        self._origin = origin
        self._grid = grid
        self._memory = memory
        self._disk = disk
        self._counts = counts
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._inflight: dict[int, ChunkFuture] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self._closed = False

    def check_open(self) -> None:
        with self._lock:
            self._check_open()

    def fetching_or_in_memory(self, index: int) -> bool:
        """Whether chunk `index` is in the reader's memory, or being fetched."""
        with self._lock:
            return index in self._inflight or self._memory.get(index) is not None

    def futures(self, indices: Sequence[int]) -> list[ChunkFuture]:
        """Each chunk, in order: from memory, or the fetch of it already under way, or a new
        fetch; new fetches of adjacent chunks go out together, as many per request as the
        origin's answers suggest. None as a result: the chunk is in the disk tier."""
        per_request = self._origin.sizer.chunks_per_request()
        futures: list[ChunkFuture] = []
        runs: list[list[tuple[int, ChunkFuture]]] = []
        with self._lock:
            self._check_open()
            for index in indices:
                self._counts.add("chunks")
                data = self._memory.get(index)
                if data is not None:
                    self._counts.add("memory_hits")
                    futures.append(_completed(data))
                    continue
                future = self._inflight.get(index)
                if future is not None:  # fetched already, by this call's runs or another's
                    self._counts.add("memory_hits")
                    futures.append(future)
                    continue
                future = Future()
                self._inflight[index] = future
                futures.append(future)
                run = runs[-1] if runs else None
                if run is not None and run[-1][0] == index - 1 and len(run) < per_request:
                    run.append((index, future))
                else:
                    runs.append([(index, future)])
            if not runs:
                return futures
            pool = self._worker_pool()
            # Submitted under the lock, as the futures were registered: `close()` cannot
            # shut the pool down in between and leave them waiting for nobody.
            tasks = []
            for run in runs:
                for index, future in run:
                    future.add_done_callback(partial(self._landed, index))
                tasks.append(pool.submit(self._load_run, run))
        for run, task in zip(runs, tasks, strict=True):
            # Outside the lock: on a task already done it runs here, and `_landed` locks.
            task.add_done_callback(partial(_settle, run))
        return futures

    def part(self, index: int, start: int, end: int) -> ChunkFuture:
        """Bytes [start, end) of chunk `index` alone, fetched for this process only."""
        with self._lock:
            self._check_open()
            self._counts.add("chunks")
            return self._worker_pool().submit(self._load_part, index, start, end)

    def in_background(self, function: Callable[..., None], *args: Any) -> Future[None]:
        """`function(*args)` on the reader's one background thread (`prefetch`)."""
        with self._lock:
            self._check_open()
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="ember-weights-prefetch"
                )
            return self._prefetcher.submit(function, *args)

    def close(self) -> None:
        """Start nothing more; cancel what has not started, wait for what has."""
        with self._lock:
            self._closed = True
            pool, prefetcher = self._pool, self._prefetcher
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if prefetcher is not None:
            prefetcher.shutdown(wait=True, cancel_futures=True)

    def _check_open(self) -> None:
        """Under `_lock`."""
        if self._closed:
            raise WeightsError(self._origin.url, "the reader is closed")

    def _worker_pool(self) -> ThreadPoolExecutor:
        """The reader's fetching threads, started on first need; under `_lock`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self._concurrency, thread_name_prefix="ember-weights"
            )
        return self._pool

    def _landed(self, index: int, future: ChunkFuture) -> None:
        with self._lock:
            if self._inflight.get(index) is future:
                del self._inflight[index]

    def _load_run(self, run: list[tuple[int, ChunkFuture]]) -> None:
        """Adjacent chunks into the disk tier (from the origin once per node, with one
        request per stretch missing there), else from the origin into memory; each
        chunk's future gets None (on disk) or its bytes."""
        indices = [index for index, _ in run]
        spans = [self._grid.bounds(index) for index in indices]
        fetched: list[tuple[int, int]] = []

        def produce(start: int, end: int) -> RangeBytes:
            fetched.append((start, end))
            return self._origin.read(start, end)

        cached = self._disk.file()
        pieces: Sequence[RangeBytes | None]
        if cached is not None:
            pieces = cached.fetch_run(spans, produce)
        else:
            pieces = split_run(produce(spans[0][0], spans[-1][1]), spans[0][0], spans)
        for (index, future), (start, end), piece in zip(run, spans, pieces, strict=True):
            if piece is None:
                came = any(low <= start and end <= high for low, high in fetched)
                self._disk.saw(index, fetched=came, lookup=False)
            else:
                self._memory.put(index, piece)
                if self._on_progress is not None:
                    self._on_progress(len(piece))
            future.set_result(piece)

    def _load_part(self, index: int, start: int, end: int) -> RangeBytes | None:
        """Bytes [start, end) of chunk `index` from the origin, into the disk tier for this
        process (None: there now), else as bytes."""
        cached = self._disk.file()
        data: RangeBytes | None
        if cached is None:
            data = self._origin.read(start, end)
        else:
            data = cached.fetch_part(
                start, end, self._grid.bounds(index), lambda: self._origin.read(start, end)
            )
        if self._on_progress is not None:
            self._on_progress(end - start)
        return data
