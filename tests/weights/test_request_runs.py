"""Adjacent chunks asked for with one request, against real origins: the HTTP test server
made to wait before each answer, and moto's S3. Chunks stay the unit of the tiers."""

from __future__ import annotations

import itertools
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from ember.errors import WeightsUnavailableError
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.by_scheme import open_origin
from ember_worker.weights.reading.options import ReaderOptions
from ember_worker.weights.reading.reader import ObjectReader

from .conftest import HttpStore, Store
from .servers import RangeServer

CHUNK = 64 * 1024
CHUNKS = 24
SIZE = CHUNKS * CHUNK - 777  # the last chunk is short
PER_REQUEST = 4
BUDGET = 64 * 2**20
# Far longer than a 64 KiB chunk takes to arrive over loopback, even on a busy machine.
WAIT_SECONDS = 0.15


def payload(seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(SIZE)


def reader_for(url: str, disk: DiskCache | None, **changes: Any) -> ObjectReader:
    settings: dict[str, Any] = {
        "chunk_bytes": CHUNK,
        "concurrency": 4,
        "max_request_bytes": PER_REQUEST * CHUNK,
        "backoff_seconds": 0.001,
    }
    settings.update(changes)
    return ObjectReader(open_origin(url), disk, ReaderOptions(**settings))


def tensors(seed: int = 2, count: int = 60) -> list[tuple[int, int]]:
    cuts = sorted({0, SIZE, *random.Random(seed).sample(range(1, SIZE), count)})
    return list(itertools.pairwise(cuts))


def asked(server: RangeServer, name: str) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of the GETs for `name`, in the order they came."""
    spans = []
    for record in server.recorded(name):
        assert record.range is not None and record.range.startswith("bytes=")
        first, last = record.range.removeprefix("bytes=").split("-")
        spans.append((int(first), int(last) + 1))
    return spans


def assert_each_byte_once_on_chunk_boundaries(spans: list[tuple[int, int]]) -> None:
    covered = 0
    for start, end in sorted(spans):
        assert start == covered, f"a gap or an overlap at {start}"
        assert start % CHUNK == 0 and (end % CHUNK == 0 or end == SIZE)
        covered = end
    assert covered == SIZE


@pytest.fixture
def waiting_server(http_server: RangeServer) -> RangeServer:
    http_server.delay_seconds = WAIT_SECONDS
    return http_server


def test_a_waiting_origin_gets_adjacent_chunks_in_one_request(
    waiting_server: RangeServer, tmp_path: Path
) -> None:
    data = payload()
    url = HttpStore(waiting_server).put("model.bin", data)
    disk = DiskCache(tmp_path / "cache", BUDGET)
    with reader_for(url, disk) as reader:
        assert b"".join(reader.read_ranges(tensors())) == data
        stats = reader.stats()
    spans = asked(waiting_server, "model.bin")
    assert_each_byte_once_on_chunk_boundaries(spans)
    sizes = [(end - start + CHUNK - 1) // CHUNK for start, end in spans]
    # Before any answer came back, one chunk per request; then as many as the bound allows.
    assert sizes[:2] == [1, 1]
    assert max(sizes) == PER_REQUEST
    assert len(spans) <= CHUNKS // 2
    assert stats["origin_requests"] == len(spans)
    assert stats["origin_bytes"] == SIZE

    # The disk tier still holds chunks: a new reader finds any one of them there.
    with reader_for(url, DiskCache(tmp_path / "cache", BUDGET)) as again:
        assert again.read(5 * CHUNK + 3, 6 * CHUNK - 2) == data[5 * CHUNK + 3 : 6 * CHUNK - 2]
        assert again.stats()["origin_requests"] == 0
        assert again.stats()["disk_hits"] == 1
    assert len(asked(waiting_server, "model.bin")) == len(spans)


def test_without_a_disk_tier_the_chunks_of_a_request_are_kept_in_memory(
    waiting_server: RangeServer,
) -> None:
    data = payload(seed=3)
    url = HttpStore(waiting_server).put("model.bin", data)
    with reader_for(url, None) as reader:
        reader.prefetch().result(timeout=60)
        assert reader.read(0, SIZE) == data
        stats = reader.stats()
    assert stats["origin_bytes"] == SIZE  # the read after the prefetch fetched nothing
    assert max(end - start for start, end in asked(waiting_server, "model.bin")) > CHUNK


def test_readers_on_one_node_fetch_each_chunk_once_whatever_their_requests(
    waiting_server: RangeServer, tmp_path: Path
) -> None:
    """Like processes on one node: each reader has a cache instance of its own over the
    same folder, so only the range locks of the data file keep them apart."""
    data = payload(seed=4)
    url = HttpStore(waiting_server).put("model.bin", data)
    results: dict[str, bytes] = {}

    def stream(name: str, ranges: list[tuple[int, int]]) -> None:
        with reader_for(url, DiskCache(tmp_path / "cache", BUDGET)) as reader:
            results[name] = b"".join(reader.read_ranges(ranges))

    whole = tensors(seed=5)
    threads = [
        threading.Thread(target=stream, args=("forward", whole)),
        threading.Thread(target=stream, args=("prefetching", whole)),
        threading.Thread(target=stream, args=("backward", whole[::-1])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results["forward"] == results["prefetching"] == data
    assert results["backward"] == b"".join(data[start:end] for start, end in whole[::-1])
    assert_each_byte_once_on_chunk_boundaries(asked(waiting_server, "model.bin"))


def test_a_failed_request_fails_every_chunk_it_carried_and_nothing_is_kept(
    waiting_server: RangeServer, tmp_path: Path
) -> None:
    data = payload(seed=6)
    url = HttpStore(waiting_server).put("model.bin", data)
    disk = DiskCache(tmp_path / "cache", BUDGET)
    with reader_for(url, disk, retries=1) as reader:
        assert reader.read(0, 2 * CHUNK) == data[: 2 * CHUNK]  # two answers: learnt to wait
        waiting_server.fail_next(2)  # both attempts of the next request
        with pytest.raises(WeightsUnavailableError, match="HTTP 503"):
            reader.read(8 * CHUNK, 12 * CHUNK)
        failed = asked(waiting_server, "model.bin")[-2:]
        assert failed[0] == failed[1] == (8 * CHUNK, 12 * CHUNK)
        # Nothing of it was kept or left waiting: the same read now succeeds.
        assert reader.read(8 * CHUNK + 1, 12 * CHUNK - 1) == data[8 * CHUNK + 1 : 12 * CHUNK - 1]


@pytest.mark.parametrize("with_disk", [True, False], ids=["disk", "no-disk"])
def test_any_origin_delivers_exact_bytes_once_whatever_the_request_sizes(
    store: Store, tmp_path: Path, with_disk: bool
) -> None:
    """Moto's S3, the HTTP server and a file, answering as fast as they can: however many
    chunks each request ends up carrying, the bytes are right and none is fetched twice."""
    data = payload(seed=7)
    disk = DiskCache(tmp_path / "cache", BUDGET) if with_disk else None
    with reader_for(store.put("model.bin", data), disk) as reader:
        ranges = tensors(seed=8)
        assert list(reader.read_ranges(ranges)) == [data[start:end] for start, end in ranges]
        assert reader.stats()["origin_bytes"] == SIZE


# -- one-off reads across chunks ---------------------------------------------------------------


def test_a_small_read_across_a_boundary_is_one_exact_request_kept_nowhere(
    http_server: RangeServer, tmp_path: Path
) -> None:
    data = payload(seed=10)
    url = HttpStore(http_server).put("model.bin", data)
    start, end = 2 * CHUNK - 40, 2 * CHUNK + 40
    with reader_for(url, DiskCache(tmp_path / "cache", BUDGET)) as reader:
        assert reader.read(start, end) == data[start:end]
        assert asked(http_server, "model.bin") == [(start, end)]
        assert reader.read(start, end) == data[start:end]  # nothing kept: asked again
        assert asked(http_server, "model.bin") == [(start, end)] * 2


def test_a_read_takes_only_its_part_of_an_edge_chunk_it_barely_needs(
    http_server: RangeServer, tmp_path: Path
) -> None:
    """Edges go into the node's file for this reader alone: it views them without a copy,
    and a read of them again asks nothing; another reader fetches such chunks whole."""
    data = payload(seed=9)
    url = HttpStore(http_server).put("model.bin", data)
    cache = tmp_path / "cache"
    start, end = CHUNK - 100, 3 * CHUNK + 50  # 100 bytes of chunk 0, 50 of chunk 3
    with reader_for(url, DiskCache(cache, BUDGET), max_request_bytes=CHUNK) as reader:
        got = reader.read(start, end)
        assert got == data[start:end]
        assert isinstance(got, memoryview)  # the mapping, not a copy
        assert sorted(asked(http_server, "model.bin")) == [
            (start, CHUNK),
            (CHUNK, 2 * CHUNK),
            (2 * CHUNK, 3 * CHUNK),
            (3 * CHUNK, end),
        ]
        assert reader.read(start, end) == data[start:end]
        assert len(asked(http_server, "model.bin")) == 4
        assert reader.stats()["origin_bytes"] == end - start
        # A read that needs more of chunk 0 than the edge takes the chunk whole.
        assert reader.read(0, 2 * CHUNK) == data[: 2 * CHUNK]
        assert asked(http_server, "model.bin")[4:] == [(0, CHUNK)]
    with reader_for(url, DiskCache(cache, BUDGET), max_request_bytes=CHUNK) as other:
        assert other.read(0, 3 * CHUNK) == data[: 3 * CHUNK]  # chunks 0-2, all whole
        assert other.stats()["origin_requests"] == 0
        assert other.read(3 * CHUNK, 3 * CHUNK + 10) == data[3 * CHUNK : 3 * CHUNK + 10]
        assert asked(http_server, "model.bin")[5:] == [(3 * CHUNK, 4 * CHUNK)]


def test_a_small_read_next_to_a_held_chunk_takes_its_part_of_the_other(
    http_server: RangeServer, tmp_path: Path
) -> None:
    data = payload(seed=11)
    url = HttpStore(http_server).put("model.bin", data)
    with reader_for(url, DiskCache(tmp_path / "cache", BUDGET), max_request_bytes=CHUNK) as reader:
        assert reader.read(CHUNK, CHUNK + 10) == data[CHUNK : CHUNK + 10]  # chunk 1 on disk
        start, end = 2 * CHUNK - 40, 2 * CHUNK + 40
        assert reader.read(start, end) == data[start:end]
        assert asked(http_server, "model.bin") == [(CHUNK, 2 * CHUNK), (2 * CHUNK, end)]


def test_edges_without_a_disk_tier_are_read_exactly_and_assembled(
    http_server: RangeServer,
) -> None:
    data = payload(seed=12)
    url = HttpStore(http_server).put("model.bin", data)
    start, end = CHUNK - 100, 2 * CHUNK + 100
    with reader_for(url, None, max_request_bytes=CHUNK) as reader:
        assert reader.read(start, end) == data[start:end]
    assert sorted(asked(http_server, "model.bin")) == [
        (start, CHUNK),
        (CHUNK, 2 * CHUNK),
        (2 * CHUNK, end),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_streams_over_a_partly_cached_object_return_exact_bytes(
    http_server: RangeServer, tmp_path: Path, seed: int
) -> None:
    """Random tensors, in order or shuffled, over an object some of whose chunks (and
    edge parts) another reader cached: mapped ranges, skipped chunks, shared chunks and
    grouped requests all meet; every range comes back exact, and no chunk is fetched
    twice on the node."""
    rng = random.Random(seed)
    data = payload(seed=20 + seed)
    http_server.delay_seconds = 0.01
    url = HttpStore(http_server).put("model.bin", data)
    cache = tmp_path / "cache"
    with reader_for(url, DiskCache(cache, BUDGET)) as warmer:
        for index in rng.sample(range(CHUNKS - 1), CHUNKS // 3):
            # Inside one chunk, or across a boundary with an edge part of 1/8 chunk.
            start = index * CHUNK + rng.choice((rng.randrange(CHUNK // 2), CHUNK - CHUNK // 8))
            end = min(start + rng.choice((CHUNK // 3, CHUNK)), SIZE)
            assert warmer.read(start, end) == data[start:end]
    ranges = tensors(seed=seed, count=rng.choice((5, 30, 80)))
    if seed % 2:
        rng.shuffle(ranges)
    with reader_for(url, DiskCache(cache, BUDGET)) as reader:
        assert list(reader.read_ranges(ranges)) == [data[start:end] for start, end in ranges]
    whole = [span for span in asked(http_server, "model.bin") if span[1] - span[0] >= CHUNK]
    fetched = [index for start, end in whole for index in range(start // CHUNK, -(-end // CHUNK))]
    assert len(fetched) == len(set(fetched))
