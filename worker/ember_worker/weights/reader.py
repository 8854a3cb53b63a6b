"""One object read by byte range through the tiers: process memory, node disk, origin.

The object is cut into aligned chunks `[i * chunk, min((i + 1) * chunk, size))`; every read
fetches the chunks it touches in parallel and assembles the exact bytes. The first `stat`
fixes the object's version: every origin read asks for that version and the disk tier is
keyed by it, so a reader never mixes chunks of two versions (a change raises
`WeightsChangedError`; open a new reader to get the new version).
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import TypeVar

from ember.errors import WeightsError, WeightsFormatError, WeightsUnavailableError
from ember_worker.weights.disk_cache import DiskCache
from ember_worker.weights.origins import ObjectVersion, Origin, TransientOriginError

_T = TypeVar("_T")

# What an origin may fail with that the next attempt may not: origins map connection errors,
# 5xx and short reads to TransientOriginError; the built-ins are a safety net.
_RETRIED = (TransientOriginError, ConnectionError, TimeoutError)


@dataclass(frozen=True)
class ReaderOptions:
    chunk_bytes: int = 16 * 2**20
    concurrency: int = 16
    retries: int = 4
    backoff_seconds: float = 0.1
    memory_bytes: int = 512 * 2**20  # the in-process tier's budget

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, not {self.chunk_bytes}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {self.concurrency}")
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
        self._chunks: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, index: int) -> bytes | None:
        with self._lock:
            data = self._chunks.get(index)
            if data is not None:
                self._chunks.move_to_end(index)
            return data

    def put(self, index: int, data: bytes) -> None:
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


def _completed(data: bytes) -> Future[bytes]:
    future: Future[bytes] = Future()
    future.set_result(data)
    return future


class ObjectReader:
    """Reads one object through the tiers. Thread-safe; `close()` when done.

    `on_progress`, if given, is called (from the reader's threads) with the size of every
    chunk brought into this process from the disk tier or the origin.
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
        # Not the global generator: user code may have seeded it and expect its sequence.
        self._jitter = random.Random()
        self._lock = threading.Lock()
        self._stat_lock = threading.Lock()
        self._version: ObjectVersion | None = None
        self._inflight: dict[int, Future[bytes]] = {}
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

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""
        span = self._chunk_span(start, end)
        futures = [self._chunk_future(index) for index in span]
        return self._assemble(start, end, span, [future.result() for future in futures])

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        """Each range's bytes in order, while the chunks of the next ranges are already being
        fetched: up to `concurrency` chunks ahead of the range being assembled."""
        ranges = list(ranges)
        spans = [self._chunk_span(start, end) for start, end in ranges]
        plan = [index for span in spans for index in span]
        pending: dict[int, Future[bytes]] = {}  # position in plan -> its chunk
        submitted = 0
        position = 0
        for (start, end), span in zip(ranges, spans, strict=True):
            past_range = position + len(span)
            horizon = min(max(past_range, position + self._options.concurrency), len(plan))
            while submitted < horizon:
                pending[submitted] = self._chunk_future(plan[submitted])
                submitted += 1
            chunks = [pending.pop(at).result() for at in range(position, past_range)]
            position = past_range
            yield self._assemble(start, end, span, chunks)

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
        """Reopen the origin's connections (after a snapshot restore they are dead)."""
        self._origin.reset()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, prefetcher = self._pool, self._prefetcher
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if prefetcher is not None:
            prefetcher.shutdown(wait=True, cancel_futures=True)

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

    def _assemble(self, start: int, end: int, span: range, chunks: list[bytes]) -> bytes:
        """The range's bytes, copied once into a bytearray of their own: the tensor built
        on it owns (and may write) its memory without another copy."""
        out = bytearray(end - start)
        if not chunks:
            return out
        chunk_bytes = self._options.chunk_bytes
        written = 0
        for index, chunk in zip(span, chunks, strict=True):
            base = index * chunk_bytes
            piece = memoryview(chunk)[max(start - base, 0) : min(end - base, len(chunk))]
            out[written : written + len(piece)] = piece
            written += len(piece)
        return out

    def _chunk_future(self, index: int) -> Future[bytes]:
        """The chunk from memory, or the fetch of it already under way, or a new fetch."""
        with self._lock:
            self._check_open()
            self._counts["chunks"] += 1
            data = self._memory.get(index)
            if data is not None:
                self._counts["memory_hits"] += 1
                return _completed(data)
            future = self._inflight.get(index)
            if future is not None:
                self._counts["memory_hits"] += 1
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._options.concurrency, thread_name_prefix="ember-weights"
                )
            future = self._pool.submit(self._load_chunk, index)
            self._inflight[index] = future
        future.add_done_callback(partial(self._landed, index))
        return future

    def _landed(self, index: int, future: Future[bytes]) -> None:
        with self._lock:
            if self._inflight.get(index) is future:
                del self._inflight[index]

    def _load_chunk(self, index: int) -> bytes:
        """Disk, else origin (once per node for the chunk); then into memory."""
        chunk = self._options.chunk_bytes
        start, end = index * chunk, min((index + 1) * chunk, self.size)
        if self._disk is None:
            data = self._from_origin(start, end)
        else:
            fetched = False

            def produce() -> bytes:
                nonlocal fetched
                fetched = True
                return self._from_origin(start, end)

            key = DiskCache.key(self.url, self.version, start, end)
            data = self._disk.fetch(key, produce, length=end - start)
            if not fetched:
                self._count("disk_hits")
        self._memory.put(index, data)
        if self._on_progress is not None:
            self._on_progress(len(data))
        return data

    def _warm(self, start: int, end: int | None) -> None:
        span = self._chunk_span(start, self.size if end is None else end)
        window: deque[Future[bytes]] = deque()
        for index in span:
            if len(window) >= self._options.concurrency:
                window.popleft().result()
            window.append(self._chunk_future(index))
        for future in window:
            future.result()

    # -- the origin ----------------------------------------------------------------------------

    def _from_origin(self, start: int, end: int) -> bytes:
        def attempt() -> bytes:
            self._count("origin_requests")
            data = self._origin.read_range(start, end, self.version)
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
            self._counts[name] += amount

    def _check_open(self) -> None:
        if self._closed:
            raise WeightsError(self.url, "the reader is closed")
