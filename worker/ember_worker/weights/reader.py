"""One object read by byte range through the tiers: process memory, node disk, origin.

The object is cut into aligned chunks `[i * chunk, min((i + 1) * chunk, size))`; every read
fetches the chunks it touches in parallel. With a disk tier the chunks go into the object's
data file on the node and a read returns a view of that file's private mapping, without a
copy (the page cache is the memory tier then); without one (or when the object cannot be
kept on disk) chunks are kept in the process's memory and each read assembles a copy.

Chunks are the unit of the tiers, not always of the origin's requests: against an origin
that makes each request wait long before its first byte, adjacent chunks of one read are
asked for with one request (`request_sizing`).

The first `stat` fixes the object's version: every origin read asks for that version and the
disk tier is keyed by it, so a reader never mixes chunks of two versions (a change raises
`WeightsChangedError`; open a new reader to get the new version).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import TypeVar

from ember.errors import WeightsError, WeightsFormatError, WeightsUnavailableError
from ember_worker.weights.disk_cache import DiskCache
from ember_worker.weights.disk_object import CachedObject, ViewUse, split_run
from ember_worker.weights.origins import ObjectVersion, Origin, TransientOriginError
from ember_worker.weights.range_buffers import RangeBytes
from ember_worker.weights.request_sizing import RequestSizer
from ember_worker.weights.totals import totals

_T = TypeVar("_T")
# What a read returns: a view of the disk tier's mapping, else a copy of its own; either is
# writable, so a tensor can be built on it without another copy.
Buffer = bytearray | memoryview

log = logging.getLogger("ember.worker.weights")

# What an origin may fail with that the next attempt may not: origins map connection errors,
# 5xx and short reads to TransientOriginError; the built-ins are a safety net.
_RETRIED = (TransientOriginError, ConnectionError, TimeoutError)

# A one-off read of less than this share of a chunk that crosses chunk boundaries, of chunks
# no tier holds, is read exactly and kept nowhere: a small tensor need not cost two chunks.
# (Larger reads take whole chunks: they are kept, and read without a copy from the disk.)
SMALL_READ_SHARE = 0.25
# A larger one-off read fetches an edge chunk it needs less than this share of as just its
# own part, written into the disk tier's file for this process only (no marker: others
# fetch that chunk whole): a 32 MiB tensor that crosses 3 KiB into a chunk costs 32 MiB,
# not 48, and is still read without a copy.
THIN_EDGE_SHARE = 0.25


@dataclass(frozen=True)
class ReaderOptions:
    chunk_bytes: int = 16 * 2**20
    concurrency: int = 16  # origin requests in flight (a stream: at most 2x this in chunks)
    # The most one request may carry when adjacent chunks are asked for together.
    # chunk_bytes (or less): one chunk per request, always.
    max_request_bytes: int = 64 * 2**20
    retries: int = 4
    backoff_seconds: float = 0.1
    memory_bytes: int = 512 * 2**20  # the in-process tier's budget

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, not {self.chunk_bytes}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {self.concurrency}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, not {self.max_request_bytes}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, not {self.retries}")
        if self.backoff_seconds < 0:
            raise ValueError(f"backoff_seconds must be >= 0, not {self.backoff_seconds}")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, not {self.memory_bytes}")


DEFAULT_OPTIONS = ReaderOptions()


class _ChunkMemory:
    """The in-process tier: chunks by index, least recently used dropped past the budget."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._chunks: OrderedDict[int, RangeBytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, index: int) -> RangeBytes | None:
        with self._lock:
            data = self._chunks.get(index)
            if data is not None:
                self._chunks.move_to_end(index)
            return data

    def put(self, index: int, data: RangeBytes) -> None:
        if len(data) > self._budget:
            return
        with self._lock:
            previous = self._chunks.pop(index, None)
            if previous is not None:
                self._bytes -= len(previous)
            self._chunks[index] = data
            self._bytes += len(data)
            while self._bytes > self._budget:
                _, dropped = self._chunks.popitem(last=False)
                self._bytes -= len(dropped)


def _plan(spans: Sequence[range]) -> tuple[list[int], list[tuple[int, int]]]:
    """The chunks a sequence of reads needs, in order, a chunk shared by two neighbouring
    reads (tensors meeting inside it) listed once; and each read's positions [low, high)
    in that list."""
    plan: list[int] = []
    places: list[tuple[int, int]] = []
    for span in spans:
        low = len(plan)
        indices = list(span)
        if indices and plan and plan[-1] == indices[0]:
            low -= 1
            indices = indices[1:]
        plan.extend(indices)
        places.append((low, len(plan)))
    return plan, places


def _settle(run: list[tuple[int, Future[RangeBytes | None]]], task: Future[None]) -> None:
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


def _completed(data: RangeBytes | None) -> Future[RangeBytes | None]:
    future: Future[RangeBytes | None] = Future()
    future.set_result(data)
    return future


class ObjectReader:
    """Reads one object through the tiers. Thread-safe; `close()` when done.

    `on_progress`, if given, is called (from the reader's threads) with the size of every
    chunk brought into this process from the disk tier or the origin, once per chunk.
    """

    def __init__(
        self,
        origin: Origin,
        disk: DiskCache | None,
        options: ReaderOptions = DEFAULT_OPTIONS,
        *,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self._origin = origin
        self._disk = disk
        self._options = options
        self._on_progress = on_progress
        self._memory = _ChunkMemory(options.memory_bytes)
        self._sizer = RequestSizer(
            options.chunk_bytes, max(1, options.max_request_bytes // options.chunk_bytes)
        )
        # Not the global generator: user code may have seeded it and expect its sequence.
        self._jitter = random.Random()
        self._lock = threading.Lock()
        self._stat_lock = threading.Lock()
        self._version: ObjectVersion | None = None
        self._inflight: dict[int, Future[RangeBytes | None]] = {}
        self._cached: CachedObject | None = None
        self._cached_opened = False
        self._seen: set[int] = set()  # chunks of the disk tier already counted and reported
        self._pool: ThreadPoolExecutor | None = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self._closed = False
        self._counts = dict.fromkeys(
            ("origin_requests", "origin_bytes", "disk_hits", "memory_hits", "chunks"), 0
        )

    @property
    def url(self) -> str:
        return self._origin.url

    @property
    def version(self) -> ObjectVersion:
        """The version every read of this reader belongs to (stat once, on first use)."""
        with self._stat_lock:
            if self._version is None:
                self._version = self._with_retries(
                    "checking the object's version", self._origin.stat
                )
            return self._version

    @property
    def size(self) -> int:
        return self.version.size

    def read(self, start: int, end: int) -> Buffer:
        """Bytes [start, end) of the object (a writable buffer of exactly that length)."""
        span = self._chunk_span(start, end)
        mapped = self._mapped(start, end, span, count=True)
        if mapped is not None:
            return mapped
        if self._small_and_unheld(start, end, span):
            self._count("chunks", len(span))
            return bytearray(self._from_origin(start, end))
        edges = self._thin_edges(start, end, span)
        if edges:
            ranges = [edges.get(index) or self._chunk_range(index) for index in span]
            mapped = self._mapped(start, end, span, count=False, ranges=ranges)
            if mapped is not None:  # this process read these edges before
                with self._lock:
                    self._bump("chunks", len(span))
                    self._bump("memory_hits", len(span))  # the page cache, via the mapping
                return mapped
        whole = [index for index in span if index not in edges]
        futures = dict(zip(whole, self._chunk_futures(whole), strict=True))
        for index, (low, high) in edges.items():
            futures[index] = self._submit(self._load_part, index, low, high)
        return self._complete(start, end, span, [futures[index] for index in span], edges)

    def peek(self, start: int, end: int) -> Buffer:
        """Bytes [start, end) for a small one-off read (a file's header): from the tiers when
        they hold all of it, else exactly these bytes from the origin, kept by neither tier.
        Whole chunks for a header would make opening a file cost a chunk per file (16 MiB,
        ~0.2 s from S3) even when no tensor of it is ever read."""
        span = self._chunk_span(start, end)
        # Not lent: the header is copied out (its probe covers the first tensors' bytes).
        mapped = self._mapped(start, end, span, count=True, use="copy")
        if mapped is not None:
            return mapped
        held = [self._memory.get(index) for index in span]
        if span and all(chunk is not None for chunk in held):
            pieces = [
                (index * self._options.chunk_bytes, chunk)
                for index, chunk in zip(span, held, strict=True)
                if chunk is not None
            ]
            return self._assemble(start, end, pieces)
        return bytearray(self._from_origin(start, end))

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> Iterator[Buffer]:
        """Each range's bytes in order, while the chunks of the next ranges are already being
        fetched: up to `concurrency` requests' worth of chunks ahead of the range being
        completed, topped up a whole request at a time so that adjacent chunks can share one."""
        ranges = list(ranges)
        spans = [self._chunk_span(start, end) for start, end in ranges]
        plan, places = _plan(spans)
        pending: dict[int, Future[RangeBytes | None]] = {}  # position in plan -> its chunk
        submitted = 0
        for (start, end), span, (low, high) in zip(ranges, spans, places, strict=True):
            for behind in [at for at in pending if at < low]:
                del pending[behind]  # no later range needs it: plans only move forward
            mapped = self._mapped(start, end, span, count=True)
            if mapped is not None:  # on disk already: nothing to fetch or wait for
                submitted = max(submitted, high)
                yield mapped
                continue
            per_request = self._sizer.chunks_per_request()
            horizon = min(max(high, low + self._chunks_ahead(per_request)), len(plan))
            if submitted < high or horizon - submitted >= per_request or horizon == len(plan):
                for offset, future in enumerate(self._chunk_futures(plan[submitted:horizon])):
                    pending[submitted + offset] = future
                submitted = max(submitted, horizon)
            # A chunk skipped while the range before it was mapped, and needed again now.
            skipped = [at for at in range(low, high) if at not in pending]
            again = self._chunk_futures([plan[at] for at in skipped])
            pending.update(zip(skipped, again, strict=True))
            futures = [pending[at] for at in range(low, high)]
            yield self._complete(start, end, span, futures)

    def prefetch(self, start: int = 0, end: int | None = None) -> Future[None]:
        """Warm the memory and disk tiers for [start, end) in the background."""
        with self._lock:
            self._check_open()
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="ember-weights-prefetch"
                )
            return self._prefetcher.submit(self._warm, start, end)

    def stats(self) -> dict[str, int]:
        """origin_requests (every attempt), origin_bytes, disk_hits, memory_hits (including
        joins of a fetch already under way) and chunks (every chunk lookup)."""
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        """Reopen the origin's connections (after a snapshot restore they are dead), and
        let go of the disk tier's mapping: a snapshot should hold no file of the node's
        cache that this reader (rather than a tensor) keeps open."""
        self._origin.reset()
        if self._cached is not None:
            self._cached.drop_mapping()

    def disk_file(self) -> CachedObject | None:
        """This object's data file in the node's disk cache, if it has one."""
        return self._disk_object()

    @property
    def disk_tier(self) -> DiskCache | None:
        return self._disk

    def move_disk_tier(self, disk: DiskCache) -> None:
        """Use `disk` as the disk tier from now on: after a restore on a node whose cache
        is at another path than the snapshot's, whose files this one must not write."""
        with self._stat_lock:
            old, self._disk = self._cached, disk
            self._cached, self._cached_opened = None, False
        if old is not None:
            old.drop_mapping()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, prefetcher = self._pool, self._prefetcher
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if prefetcher is not None:
            prefetcher.shutdown(wait=True, cancel_futures=True)
        if self._cached is not None:
            self._cached.drop_mapping()  # tensors built on it keep it as long as they live

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- chunks --------------------------------------------------------------------------------

    def _chunk_span(self, start: int, end: int) -> range:
        """The indices of the chunks [start, end) touches, after checking the range."""
        size = self.size
        if not 0 <= start <= end <= size:
            raise WeightsFormatError(
                self.url, f"range [{start}, {end}) beyond the object's {size} bytes"
            )
        if start == end:
            return range(0)
        chunk = self._options.chunk_bytes
        return range(start // chunk, (end - 1) // chunk + 1)

    def _chunk_range(self, index: int) -> tuple[int, int]:
        chunk = self._options.chunk_bytes
        return index * chunk, min((index + 1) * chunk, self.size)

    def _disk_object(self) -> CachedObject | None:
        """This version's place in the disk tier, or None when there is none."""
        with self._stat_lock:
            opened = self._cached_opened
        if not opened:
            version = self.version
            cached = None if self._disk is None else self._disk.open(self.url, version)
            with self._stat_lock:
                if not self._cached_opened:
                    self._cached, self._cached_opened = cached, True
        return self._cached

    def _mapped(
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
        with self._lock:
            self._check_open()
        cached = self._disk_object()
        if cached is None or not span:
            return None
        if ranges is None:
            ranges = [self._chunk_range(index) for index in span]
        try:
            view = cached.view(start, end, ranges, use=use)
        except OSError as error:
            log.warning("weights cache unusable for %s, reading around it: %s", self.url, error)
            return None
        if view is not None and count:
            for index in span:
                self._saw_on_disk(index, fetched=False, lookup=True)
        return view

    def _saw_on_disk(self, index: int, *, fetched: bool, lookup: bool) -> None:
        """Count a chunk found in (or just put into) the disk tier; report it the first time."""
        with self._lock:
            if lookup:
                self._bump("chunks")
            first = index not in self._seen
            self._seen.add(index)
            if not first:
                if lookup:
                    self._bump("memory_hits")  # the page cache, via the mapping
                return
            if not fetched:
                self._bump("disk_hits")
        if self._on_progress is not None:
            start, end = self._chunk_range(index)
            self._on_progress(end - start)

    def _complete(
        self,
        start: int,
        end: int,
        span: range,
        futures: list[Future[RangeBytes | None]],
        edges: Mapping[int, tuple[int, int]] | None = None,
    ) -> Buffer:
        """The range once its chunks are in: mapped when all are on disk, else assembled.
        For the chunks in `edges` only that part of them, (start, end), was read."""
        edges = edges or {}
        chunks = [future.result() for future in futures]
        if not span:
            return bytearray()
        if all(chunk is None for chunk in chunks):
            ranges = [edges.get(index) or self._chunk_range(index) for index in span]
            mapped = self._mapped(start, end, span, count=False, ranges=ranges)
            if mapped is not None:
                return mapped
        pieces: list[tuple[int, RangeBytes | Buffer]] = []
        for index, chunk in zip(span, chunks, strict=True):
            part = edges.get(index)
            if part is not None:  # evicted since, if on disk: ask again
                pieces.append((part[0], chunk if chunk is not None else self._from_origin(*part)))
            else:
                low = self._chunk_range(index)[0]
                pieces.append((low, chunk if chunk is not None else self._disk_chunk(index)))
        return self._assemble(start, end, pieces)

    def _thin_edges(self, start: int, end: int, span: range) -> dict[int, tuple[int, int]]:
        """Edge chunks of a read across chunks that it needs little of (THIN_EDGE_SHARE)
        and that no tier holds or is fetching whole: index -> the part the read needs."""
        if len(span) < 2:
            return {}
        edges = {}
        for index in (span[0], span[-1]):
            low, high = self._chunk_range(index)
            part = (max(start, low), min(end, high))
            if part[1] - part[0] < THIN_EDGE_SHARE * (high - low) and not self._held(index):
                edges[index] = part
        return edges

    def _held(self, index: int) -> bool:
        """Whether a tier holds chunk `index`, or it is being fetched."""
        with self._lock:
            if index in self._inflight or self._memory.get(index) is not None:
                return True
        cached = self._disk_object()
        if cached is None:
            return False
        low, high = self._chunk_range(index)
        try:
            return cached.view(low, high, [(low, high)], use="check") is not None
        except OSError:  # an unusable cache holds nothing
            return False

    def _load_part(self, index: int, start: int, end: int) -> RangeBytes | None:
        """Bytes [start, end) of chunk `index` from the origin, into the disk tier for this
        process (None: there now), else as bytes."""
        cached = self._disk_object()
        data: RangeBytes | None
        if cached is None:
            data = self._from_origin(start, end)
        else:
            data = cached.fetch_part(
                start, end, self._chunk_range(index), lambda: self._from_origin(start, end)
            )
        if self._on_progress is not None:
            self._on_progress(end - start)
        return data

    def _submit(self, function: Callable[..., _T], *args: object) -> Future[_T]:
        with self._lock:
            self._check_open()
            self._bump("chunks")
            return self._worker_pool().submit(function, *args)

    def _chunks_ahead(self, per_request: int) -> int:
        """How many chunks a stream keeps in flight: `concurrency` requests, but never more
        than twice `concurrency` chunks, so grouped requests cannot multiply the memory in
        flight (fewer, larger requests still beat many small ones where grouping pays)."""
        return self._options.concurrency * min(per_request, 2)

    def _worker_pool(self) -> ThreadPoolExecutor:
        """The reader's fetching threads, started on first need; under `_lock`."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self._options.concurrency, thread_name_prefix="ember-weights"
            )
        return self._pool

    def _small_and_unheld(self, start: int, end: int, span: range) -> bool:
        """Whether a read is small, crosses chunks, and finds none of them in a tier or
        being fetched (see SMALL_READ_SHARE)."""
        if len(span) < 2 or end - start >= SMALL_READ_SHARE * self._options.chunk_bytes:
            return False
        return not any(self._held(index) for index in span)

    def _disk_chunk(self, index: int) -> RangeBytes | Buffer:
        """A chunk the disk tier had a moment ago: a view of the mapping (copied once, by
        `_assemble`), or from the origin when the object was evicted (or changed on
        disk) meanwhile."""
        start, end = self._chunk_range(index)
        # Copied by `_assemble`, not handed out.
        mapped = self._mapped(start, end, range(index, index + 1), count=False, use="copy")
        if mapped is not None:
            return mapped
        data = self._from_origin(start, end)
        self._memory.put(index, data)
        return data

    def _assemble(
        self, start: int, end: int, pieces: Sequence[tuple[int, RangeBytes | Buffer]]
    ) -> bytearray:
        """The range's bytes, copied once into a bytearray of their own: the tensor built
        on it owns (and may write) its memory without another copy. `pieces`: (offset in
        the object, bytes) covering the range in order (whole chunks or parts of them)."""
        out = bytearray(end - start)
        written = 0
        for base, data in pieces:
            piece = memoryview(data)[max(start - base, 0) : min(end - base, len(data))]
            out[written : written + len(piece)] = piece
            written += len(piece)
        return out

    def _chunk_futures(self, indices: Sequence[int]) -> list[Future[RangeBytes | None]]:
        """Each chunk, in order: from memory, or the fetch of it already under way, or a new
        fetch; new fetches of adjacent chunks go out together, as many per request as the
        origin's answers suggest. None as a result: the chunk is in the disk tier."""
        per_request = self._sizer.chunks_per_request()
        futures: list[Future[RangeBytes | None]] = []
        runs: list[list[tuple[int, Future[RangeBytes | None]]]] = []
        with self._lock:
            self._check_open()
            for index in indices:
                self._bump("chunks")
                data = self._memory.get(index)
                if data is not None:
                    self._bump("memory_hits")
                    futures.append(_completed(data))
                    continue
                future = self._inflight.get(index)
                if future is not None:  # fetched already, by this call's runs or another's
                    self._bump("memory_hits")
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

    def _landed(self, index: int, future: Future[RangeBytes | None]) -> None:
        with self._lock:
            if self._inflight.get(index) is future:
                del self._inflight[index]

    def _load_run(self, run: list[tuple[int, Future[RangeBytes | None]]]) -> None:
        """Adjacent chunks into the disk tier (from the origin once per node, with one
        request per stretch missing there), else from the origin into memory; each
        chunk's future gets None (on disk) or its bytes."""
        indices = [index for index, _ in run]
        spans = [self._chunk_range(index) for index in indices]
        fetched: list[tuple[int, int]] = []

        def produce(start: int, end: int) -> RangeBytes:
            fetched.append((start, end))
            return self._from_origin(start, end)

        cached = self._disk_object()
        pieces: Sequence[RangeBytes | None]
        if cached is not None:
            pieces = cached.fetch_run(spans, produce)
        else:
            pieces = split_run(produce(spans[0][0], spans[-1][1]), spans[0][0], spans)
        for (index, future), (start, end), piece in zip(run, spans, pieces, strict=True):
            if piece is None:
                came = any(low <= start and end <= high for low, high in fetched)
                self._saw_on_disk(index, fetched=came, lookup=False)
            else:
                self._memory.put(index, piece)
                if self._on_progress is not None:
                    self._on_progress(len(piece))
            future.set_result(piece)

    def _warm(self, start: int, end: int | None) -> None:
        indices = list(self._chunk_span(start, self.size if end is None else end))
        window: deque[Future[RangeBytes | None]] = deque()
        at = 0
        while at < len(indices):
            per_request = self._sizer.chunks_per_request()
            while len(window) >= self._chunks_ahead(per_request):
                window.popleft().result()
            batch = indices[at : at + per_request]
            at += len(batch)
            window.extend(self._chunk_futures(batch))
        for future in window:
            future.result()

    # -- the origin ----------------------------------------------------------------------------

    def _from_origin(self, start: int, end: int) -> RangeBytes:
        def attempt() -> RangeBytes:
            self._count("origin_requests")
            first_byte: list[float] = []
            sent = time.monotonic()
            data = self._origin.read_range(
                start, end, self.version, on_first_byte=lambda: first_byte.append(time.monotonic())
            )
            if first_byte:
                self._sizer.record(len(data), first_byte[0] - sent, time.monotonic() - sent)
            self._count("origin_bytes", len(data))
            return data

        return self._with_retries(f"reading bytes {start}-{end - 1}", attempt)

    def _with_retries(self, what: str, attempt: Callable[[], _T]) -> _T:
        """Retry transient failures with exponential backoff and jitter; anything that says
        the object is missing, forbidden or changed is final at once."""
        attempts = self._options.retries + 1
        last: BaseException | None = None
        for number in range(attempts):
            try:
                return attempt()
            except _RETRIED as error:
                last = error
            if number + 1 < attempts:
                delay = self._options.backoff_seconds * 2**number
                time.sleep(delay * (0.5 + 0.5 * self._jitter.random()))
        raise WeightsUnavailableError(
            self.url, f"{what} failed {attempts} times; last error: {last}"
        ) from last

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._bump(name, amount)

    def _bump(self, name: str, amount: int = 1) -> None:
        """Count for this reader and for the process (`totals`); under `_lock`."""
        self._counts[name] += amount
        totals.add(name, amount)

    def _check_open(self) -> None:
        if self._closed:
            raise WeightsError(self.url, "the reader is closed")
