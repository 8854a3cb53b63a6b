"""The bytes of an image's files, read by range from its layer tars through the node's
tiers: checked chunks in this process's memory, the node's disk cache (the weights'
`ObjectReader` and `DiskCache`: sparse files, chunk markers and range locks), the store.
A chunk from the store is served at once and written to the disk tier behind the read
(its fdatasync would otherwise be the read's; this process fetches a chunk once). A
chunk is checked against the index's SHA-256 when it comes into
memory, before any of it is served: one that does not match is fetched once more from
the store past the disk (a damaged disk copy), and refused if that does not match
either (`CorruptChunk`: the file system answers EIO)."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ember_worker.images.lazy.file_index import FileIndex
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.cache.disk_object import CachedObject
from ember_worker.weights.origins.origin import Origin
from ember_worker.weights.reading.options import ReaderOptions
from ember_worker.weights.reading.reader import ObjectReader

log = logging.getLogger("ember.worker.images")

MEMORY_BYTES = 256 * 1024 * 1024


class CorruptChunk(Exception):
    pass


class ImageContents:
    """Thread-safe. `origin_for(sha256, size)` opens the origin of one layer tar."""

    def __init__(
        self,
        index: FileIndex,
        origin_for: Callable[[str, int], Origin],
        disk: DiskCache | None,
        memory_bytes: int = MEMORY_BYTES,
    ) -> None:
        self.index = index
        self._chunk = index.chunk_bytes
        # One chunk per request, chunks of the check's size: a read fetches what it
        # checks, and adjacent chunks of one read share a request.
        options = ReaderOptions(
            chunk_bytes=self._chunk, max_request_bytes=8 * self._chunk, memory_bytes=0
        )
        self._origins = [origin_for(s.sha256, s.size) for s in index.sources]
        self._readers = [ObjectReader(origin, disk, options) for origin in self._origins]
        self._memory: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._memory_bytes = memory_bytes
        self._held = 0
        self._lock = threading.Lock()
        self._loading: dict[tuple[int, int], Future[bytes]] = {}
        self.refused = 0
        # Writes into the disk tier, behind the reads that wait for none of them.
        self._background = ThreadPoolExecutor(2, thread_name_prefix="ember-image-disk")

    def read(self, source: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of layer tar `source`, every chunk of them checked."""
        if end <= start:
            return b""
        first, last = start // self._chunk, (end - 1) // self._chunk
        pieces = [self._checked(source, n) for n in range(first, last + 1)]
        base = first * self._chunk
        if len(pieces) == 1:
            return pieces[0][start - base : end - base]
        return b"".join(pieces)[start - base : end - base]

    def cached(self, source: int, start: int, end: int) -> bytes | None:
        """The range when memory holds all of it (no fetch, no wait), else None."""
        if end <= start:
            return b""
        first, last = start // self._chunk, (end - 1) // self._chunk
        with self._lock:
            pieces = []
            for n in range(first, last + 1):
                data = self._memory.get((source, n))
                if data is None:
                    return None
                self._memory.move_to_end((source, n))
                pieces.append(data)
        base = first * self._chunk
        return b"".join(pieces)[start - base : end - base]

    def stats(self) -> dict[str, int]:
        """Bytes and requests the store answered (all layer tars), chunks refused."""
        return {
            "origin_bytes": sum(o.bytes_read for o in self._origins),
            "origin_requests": sum(o.requests for o in self._origins),
            "refused_chunks": self.refused,
        }

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)
        for reader in self._readers:
            reader.close()

    def _checked(self, source: int, number: int) -> bytes:
        key = (source, number)
        with self._lock:
            data = self._memory.get(key)
            if data is not None:
                self._memory.move_to_end(key)
                return data
            loading = self._loading.get(key)
            mine = loading is None
            if loading is None:
                loading = self._loading[key] = Future()
        if not mine:
            return loading.result()
        try:
            data = self._load(source, number)
        except BaseException as error:
            with self._lock:
                del self._loading[key]
            loading.set_exception(error)
            raise
        with self._lock:
            del self._loading[key]
            self._remember(key, data)
        loading.set_result(data)
        return data

    def _load(self, source: int, number: int) -> bytes:
        layer = self.index.sources[source]
        if number >= len(layer.chunks):
            raise CorruptChunk(f"layer tar {layer.sha256[:12]} has no chunk {number}")
        start = number * self._chunk
        end = min(start + self._chunk, layer.size)
        reader = self._readers[source]
        # The disk tier's copy, else the store's bytes at once: the read waits for
        # neither the disk write nor its fdatasync, done behind it.
        data = bytes(reader.peek(start, end))
        if hashlib.sha256(data).digest() != layer.chunks[number]:
            # The disk's copy may be the damaged one: the store's, past the disk.
            data = bytes(self._origins[source].read_range(start, end, reader.version))
            if hashlib.sha256(data).digest() != layer.chunks[number]:
                self.refused += 1
                log.error(
                    "layer tar %s: chunk %d does not match the index", layer.sha256[:12], number
                )
                raise CorruptChunk(f"layer tar {layer.sha256[:12]}: chunk {number} does not match")
            log.warning("layer tar %s: chunk %d was damaged on disk", layer.sha256[:12], number)
            return data
        cached = reader.disk_file()
        if cached is not None:  # a marker already there: nothing is written
            self._background.submit(_keep, cached, start, end, data)
        return data

    def _remember(self, key: tuple[int, int], data: bytes) -> None:
        self._memory[key] = data
        self._held += len(data)
        while self._held > self._memory_bytes and len(self._memory) > 1:
            _, dropped = self._memory.popitem(last=False)
            self._held -= len(dropped)


def _keep(cached: CachedObject, start: int, end: int, data: bytes) -> None:
    """A checked chunk into the node's disk tier (locked, durable, then marked), unless
    it is there already."""
    try:
        cached.fetch_run([(start, end)], lambda first, last: data)
    except Exception as error:  # the disk tier only saves later fetches
        log.warning("could not keep a chunk on the node's disk: %s", error)
