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

`ObjectReader` decides how each read is served; its parts do the rest: `OriginReads` (the
origin, with retries), `ChunkGrid` (where chunks lie), `ChunkMemory` (the in-process tier),
`DiskPlace` (the object in the disk tier), `ChunkFetcher` (the threads that fetch chunks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType

from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.cache.disk_object import CachedObject, ViewUse
from ember_worker.weights.origins.origin import ObjectVersion, Origin
from ember_worker.weights.origins.range_buffers import RangeBytes
from ember_worker.weights.reading.chunk_fetch import ChunkFetcher, ChunkFuture
from ember_worker.weights.reading.chunk_grid import ChunkGrid, plan_reads
from ember_worker.weights.reading.chunk_memory import ChunkMemory
from ember_worker.weights.reading.disk_place import DiskPlace
from ember_worker.weights.reading.options import DEFAULT_OPTIONS, ReaderOptions
from ember_worker.weights.reading.origin_reads import OriginReads
from ember_worker.weights.reading.read_counts import ReadCounts

# What a read returns: a view of the disk tier's mapping, else a copy of its own; either is
# writable, so a tensor can be built on it without another copy.
Buffer = bytearray | memoryview

# A one-off read of less than this share of a chunk that crosses chunk boundaries, of chunks
# no tier holds, is read exactly and kept nowhere: a small tensor need not cost two chunks.
# (Larger reads take whole chunks: they are kept, and read without a copy from the disk.)
SMALL_READ_SHARE = 0.25
# A larger one-off read fetches an edge chunk it needs less than this share of as just its
# own part, written into the disk tier's file for this process only (no marker: others
# fetch that chunk whole): a 32 MiB tensor that crosses 3 KiB into a chunk costs 32 MiB,
# not 48, and is still read without a copy.
THIN_EDGE_SHARE = 0.25


def assemble(start: int, end: int, pieces: Sequence[tuple[int, RangeBytes | Buffer]]) -> bytearray:
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
        self._options = options
        self._counts = ReadCounts()
        self._origin = OriginReads(origin, options, self._counts)
        self._grid = ChunkGrid(options.chunk_bytes, self._origin)
        self._memory = ChunkMemory(options.memory_bytes)
        self._disk = DiskPlace(disk, self._origin, self._grid, self._counts, on_progress)
        self._fetcher = ChunkFetcher(
            options.concurrency,
            self._origin,
            self._grid,
            self._memory,
            self._disk,
            self._counts,
            on_progress,
        )

    @property
    def url(self) -> str:
        return self._origin.url

    @property
    def version(self) -> ObjectVersion:
        """The version every read of this reader belongs to (stat once, on first use)."""
        return self._origin.version

    @property
    def size(self) -> int:
        return self.version.size

    def read(self, start: int, end: int) -> Buffer:
        """Bytes [start, end) of the object (a writable buffer of exactly that length)."""
        span = self._grid.span(start, end)
        mapped = self._mapped(start, end, span, count=True)
        if mapped is not None:
            return mapped
        if self._small_and_unheld(start, end, span):
            self._counts.add("chunks", len(span))
            return bytearray(self._origin.read(start, end))
        edges = self._thin_edges(start, end, span)
        if edges:
            ranges = [edges.get(index) or self._grid.bounds(index) for index in span]
            mapped = self._mapped(start, end, span, count=False, ranges=ranges)
            if mapped is not None:  # this process read these edges before
                self._counts.add("chunks", len(span))
                self._counts.add("memory_hits", len(span))  # the page cache, via the mapping
                return mapped
        whole = [index for index in span if index not in edges]
        futures = dict(zip(whole, self._fetcher.futures(whole), strict=True))
        for index, (low, high) in edges.items():
            futures[index] = self._fetcher.part(index, low, high)
        return self._complete(start, end, span, [futures[index] for index in span], edges)

    def peek(self, start: int, end: int) -> Buffer:
        """Bytes [start, end) for a small one-off read (a file's header): from the tiers when
        they hold all of it, else exactly these bytes from the origin, kept by neither tier.
        Whole chunks for a header would make opening a file cost a chunk per file (16 MiB,
        ~0.2 s from S3) even when no tensor of it is ever read."""
        span = self._grid.span(start, end)
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
            return assemble(start, end, pieces)
        return bytearray(self._origin.read(start, end))

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> Iterator[Buffer]:
        """Each range's bytes in order, while the chunks of the next ranges are already being
        fetched: up to `concurrency` requests' worth of chunks ahead of the range being
        completed, topped up a whole request at a time so that adjacent chunks can share one."""
        ranges = list(ranges)
        spans = [self._grid.span(start, end) for start, end in ranges]
        plan, places = plan_reads(spans)
        pending: dict[int, ChunkFuture] = {}  # position in plan -> its chunk
        submitted = 0
        for (start, end), span, (low, high) in zip(ranges, spans, places, strict=True):
            for behind in [at for at in pending if at < low]:
                del pending[behind]  # no later range needs it: plans only move forward
            mapped = self._mapped(start, end, span, count=True)
            if mapped is not None:  # on disk already: nothing to fetch or wait for
                submitted = max(submitted, high)
                yield mapped
                continue
            per_request = self._origin.sizer.chunks_per_request()
            horizon = min(max(high, low + self._chunks_ahead(per_request)), len(plan))
            if submitted < high or horizon - submitted >= per_request or horizon == len(plan):
                new = self._fetcher.futures(plan[submitted:horizon])
                for offset, future in enumerate(new):
                    pending[submitted + offset] = future
                submitted = max(submitted, horizon)
            # A chunk skipped while the range before it was mapped, and needed again now.
            skipped = [at for at in range(low, high) if at not in pending]
            again = self._fetcher.futures([plan[at] for at in skipped])
            pending.update(zip(skipped, again, strict=True))
            futures = [pending[at] for at in range(low, high)]
            yield self._complete(start, end, span, futures)

    def prefetch(self, start: int = 0, end: int | None = None) -> Future[None]:
        """Warm the memory and disk tiers for [start, end) in the background."""
        return self._fetcher.in_background(self._warm, start, end)

    def stats(self) -> dict[str, int]:
        """origin_requests (every attempt), origin_bytes, disk_hits, memory_hits (including
        joins of a fetch already under way) and chunks (every chunk lookup)."""
        return self._counts.snapshot()

    def reset(self) -> None:
        """Reopen the origin's connections (after a snapshot restore they are dead), and
        let go of the disk tier's mapping: a snapshot should hold no file of the node's
        cache that this reader (rather than a tensor) keeps open."""
        self._origin.reset()
        self._disk.drop_mapping()

    def disk_file(self) -> CachedObject | None:
        """This object's data file in the node's disk cache, if it has one."""
        return self._disk.file()

    @property
    def disk_tier(self) -> DiskCache | None:
        return self._disk.tier

    def move_disk_tier(self, disk: DiskCache) -> None:
        """Use `disk` as the disk tier from now on: after a restore on a node whose cache
        is at another path than the snapshot's, whose files this one must not write."""
        self._disk.move(disk)

    def close(self) -> None:
        self._fetcher.close()
        self._disk.drop_mapping()  # tensors built on it keep it as long as they live

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- how a read is served ------------------------------------------------------------------

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
        self._fetcher.check_open()
        return self._disk.mapped(start, end, span, count=count, ranges=ranges, use=use)

    def _complete(
        self,
        start: int,
        end: int,
        span: range,
        futures: list[ChunkFuture],
        edges: Mapping[int, tuple[int, int]] | None = None,
    ) -> Buffer:
        """The range once its chunks are in: mapped when all are on disk, else assembled.
        For the chunks in `edges` only that part of them, (start, end), was read."""
        edges = edges or {}
        chunks = [future.result() for future in futures]
        if not span:
            return bytearray()
        if all(chunk is None for chunk in chunks):
            ranges = [edges.get(index) or self._grid.bounds(index) for index in span]
            mapped = self._mapped(start, end, span, count=False, ranges=ranges)
            if mapped is not None:
                return mapped
        pieces: list[tuple[int, RangeBytes | Buffer]] = []
        for index, chunk in zip(span, chunks, strict=True):
            part = edges.get(index)
            if part is not None:  # evicted since, if on disk: ask again
                pieces.append((part[0], chunk if chunk is not None else self._origin.read(*part)))
            else:
                low = self._grid.bounds(index)[0]
                pieces.append((low, chunk if chunk is not None else self._disk_chunk(index)))
        return assemble(start, end, pieces)

    def _thin_edges(self, start: int, end: int, span: range) -> dict[int, tuple[int, int]]:
        """Edge chunks of a read across chunks that it needs little of (THIN_EDGE_SHARE)
        and that no tier holds or is fetching whole: index -> the part the read needs."""
        if len(span) < 2:
            return {}
        edges = {}
        for index in (span[0], span[-1]):
            low, high = self._grid.bounds(index)
            part = (max(start, low), min(end, high))
            if part[1] - part[0] < THIN_EDGE_SHARE * (high - low) and not self._held(index):
                edges[index] = part
        return edges

    def _held(self, index: int) -> bool:
        """Whether a tier holds chunk `index`, or it is being fetched."""
        return self._fetcher.fetching_or_in_memory(index) or self._disk.holds(index)

    def _small_and_unheld(self, start: int, end: int, span: range) -> bool:
        """Whether a read is small, crosses chunks, and finds none of them in a tier or
        being fetched (see SMALL_READ_SHARE)."""
        if len(span) < 2 or end - start >= SMALL_READ_SHARE * self._options.chunk_bytes:
            return False
        return not any(self._held(index) for index in span)

    def _disk_chunk(self, index: int) -> RangeBytes | Buffer:
        """A chunk the disk tier had a moment ago: a view of the mapping (copied once, by
        `assemble`), or from the origin when the object was evicted (or changed on
        disk) meanwhile."""
        start, end = self._grid.bounds(index)
        # Copied by `assemble`, not handed out.
        mapped = self._mapped(start, end, range(index, index + 1), count=False, use="copy")
        if mapped is not None:
            return mapped
        data = self._origin.read(start, end)
        self._memory.put(index, data)
        return data

    def _chunks_ahead(self, per_request: int) -> int:
        """How many chunks a stream keeps in flight: `concurrency` requests, but never more
        than twice `concurrency` chunks, so grouped requests cannot multiply the memory in
        flight (fewer, larger requests still beat many small ones where grouping pays)."""
        return self._options.concurrency * min(per_request, 2)

    def _warm(self, start: int, end: int | None) -> None:
        indices = list(self._grid.span(start, self.size if end is None else end))
        window: deque[ChunkFuture] = deque()
        at = 0
        while at < len(indices):
            per_request = self._origin.sizer.chunks_per_request()
            while len(window) >= self._chunks_ahead(per_request):
                window.popleft().result()
            batch = indices[at : at + per_request]
            at += len(batch)
            window.extend(self._fetcher.futures(batch))
        for future in window:
            future.result()
