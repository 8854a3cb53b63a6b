"""The tiers of the weights cache against real origins: local files, an HTTP server with
Range support, and moto's S3 server; other processes through real subprocesses."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.errors import (
    WeightsAccessDeniedError,
    WeightsChangedError,
    WeightsError,
    WeightsFormatError,
    WeightsNotFoundError,
    WeightsUnavailableError,
)
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.by_scheme import open_origin
from ember_worker.weights.origins.file import FileOrigin
from ember_worker.weights.origins.origin import ObjectVersion
from ember_worker.weights.origins.s3 import S3Origin
from ember_worker.weights.reading.options import ReaderOptions
from ember_worker.weights.reading.reader import ObjectReader

from .conftest import HttpStore, S3Store, Store
from .servers import S3Server

CHUNK = 64 * 1024
CHUNKS = 5
SIZE = CHUNKS * CHUNK - 1234  # the last chunk is short
BIG_BUDGET = 64 * 2**20

MakeReader = Callable[..., ObjectReader]


def payload(size: int = SIZE, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def options(**changes: Any) -> ReaderOptions:
    # One chunk per request unless a test asks otherwise: most tests count requests per chunk.
    settings: dict[str, Any] = {
        "chunk_bytes": CHUNK,
        "concurrency": 4,
        "backoff_seconds": 0.001,
        "max_request_bytes": CHUNK,
    }
    settings.update(changes)
    return ReaderOptions(**settings)


@pytest.fixture
def disk(tmp_path: Path) -> DiskCache:
    return DiskCache(tmp_path / "cache", BIG_BUDGET)


@pytest.fixture
def make_reader() -> Iterator[MakeReader]:
    """Readers over `open_origin(url)`, closed after the test."""
    readers: list[ObjectReader] = []

    def make(url: str, disk: DiskCache | None = None, **changes: Any) -> ObjectReader:
        reader = ObjectReader(open_origin(url), disk, options(**changes))
        readers.append(reader)
        return reader

    yield make
    for reader in readers:
        reader.close()


# -- another process on the node -------------------------------------------------------------

_CHILD = r"""
import hashlib, json, sys
from pathlib import Path
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.by_scheme import open_origin
from ember_worker.weights.reading.options import ReaderOptions
from ember_worker.weights.reading.reader import ObjectReader

url, root, chunk_bytes, budget = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
options = ReaderOptions(chunk_bytes=chunk_bytes, concurrency=4)
with ObjectReader(open_origin(url), DiskCache(root, budget), options) as reader:
    reader.version  # the version check is not the race under test
    print("ready", flush=True)
    sys.stdin.readline()
    data = reader.read(0, reader.size)
    print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), **reader.stats()}), flush=True)
"""


class ReaderProcess:
    """A separate Python process reading a whole object through a disk cache; it starts
    reading when told to, so that two of them can race."""

    def __init__(self, url: str, cache_root: Path, budget: int = BIG_BUDGET) -> None:
        command = [sys.executable, "-c", _CHILD, url, str(cache_root), str(CHUNK), str(budget)]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            _, errors = self.process.communicate(timeout=30)
            raise AssertionError(f"reader process failed to start: {line}{errors}")

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def result(self) -> dict[str, Any]:
        output, errors = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, errors
        report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        return report


def read_in_other_processes(url: str, cache_root: Path, count: int, **kwargs: Any) -> list[dict]:
    processes = [ReaderProcess(url, cache_root, **kwargs) for _ in range(count)]
    for process in processes:
        process.wait_ready()
    for process in processes:
        process.go()
    return [process.result() for process in processes]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- reading ---------------------------------------------------------------------------------


def test_ranged_reads_return_exact_bytes(
    store: Store, make_reader: MakeReader, disk: DiskCache
) -> None:
    data = payload()
    reader = make_reader(store.put("model.bin", data), disk)
    ranges = [
        (0, 0),
        (0, 1),
        (CHUNK - 1, CHUNK + 1),
        (CHUNK, 2 * CHUNK),
        (10, 3 * CHUNK + 7),
        (2 * CHUNK + 5, 2 * CHUNK + 5),
        (SIZE - 1, SIZE),
        (0, SIZE),
    ]
    assert reader.size == SIZE
    for start, end in ranges:
        assert reader.read(start, end) == data[start:end], (start, end)
    assert list(reader.read_ranges(ranges)) == [data[start:end] for start, end in ranges]


def test_read_ranges_streams_consecutive_ranges(store: Store, make_reader: MakeReader) -> None:
    data = payload(seed=1)
    reader = make_reader(store.put("model.bin", data), concurrency=2)
    cuts = sorted({0, SIZE, *random.Random(2).sample(range(1, SIZE), 40)})
    tensors = list(itertools.pairwise(cuts))
    assert b"".join(reader.read_ranges(tensors)) == data
    # Each chunk came from the origin once, however many tensors shared it.
    assert reader.stats()["origin_requests"] == CHUNKS


def test_only_the_touched_chunks_are_fetched(store: Store) -> None:
    data = payload()
    origin = open_origin(store.put("model.bin", data))
    with ObjectReader(origin, None, options()) as reader:
        assert reader.read(CHUNK + 10, 3 * CHUNK - 10) == data[CHUNK + 10 : 3 * CHUNK - 10]
        stats = reader.stats()
    assert stats["origin_requests"] == origin.requests == 2
    assert stats["origin_bytes"] == origin.bytes_read == 2 * CHUNK
    if isinstance(store, HttpStore):
        asked = [record.range for record in store.server.recorded("model.bin")]
        assert set(asked) == {
            f"bytes={CHUNK}-{2 * CHUNK - 1}",
            f"bytes={2 * CHUNK}-{3 * CHUNK - 1}",
        }
        assert len(asked) == 2


@pytest.mark.parametrize("with_disk", [True, False], ids=["disk", "no-disk"])
def test_the_memory_tier_serves_a_repeated_read(
    store: Store, make_reader: MakeReader, tmp_path: Path, with_disk: bool
) -> None:
    root = tmp_path / "cache"
    disk = DiskCache(root, BIG_BUDGET) if with_disk else None
    data = payload()
    reader = make_reader(store.put("model.bin", data), disk)
    assert reader.read(0, SIZE) == data
    before = reader.stats()
    # With a disk tier the reader's mapping of the object's file (its inode outlives the
    # unlink) is the memory tier; any disk lookup now would miss and refetch, or recreate it.
    shutil.rmtree(root, ignore_errors=True)
    assert reader.read(0, SIZE) == data
    after = reader.stats()
    assert after["origin_requests"] == before["origin_requests"] == CHUNKS
    assert after["disk_hits"] == before["disk_hits"] == 0
    assert after["memory_hits"] == before["memory_hits"] + CHUNKS
    assert not root.exists()


def test_prefetch_warms_the_tiers(
    http_store: HttpStore, make_reader: MakeReader, disk: DiskCache
) -> None:
    data = payload()
    reader = make_reader(http_store.put("model.bin", data), disk)
    reader.prefetch().result(timeout=30)
    assert reader.stats()["origin_requests"] == CHUNKS
    assert reader.read(0, SIZE) == data
    assert reader.stats()["origin_requests"] == CHUNKS
    assert http_store.server.gets("model.bin") == CHUNKS
    with pytest.raises(WeightsFormatError):
        reader.prefetch(0, SIZE + 1).result(timeout=30)


def test_progress_counts_every_chunk_brought_in(file_store: Store, disk: DiskCache) -> None:
    data = payload()
    progress: list[int] = []
    url = file_store.put("model.bin", data)
    with ObjectReader(open_origin(url), disk, options(), on_progress=progress.append) as reader:
        assert reader.read(0, SIZE) == data
        assert reader.read(0, SIZE) == data  # from memory: nothing brought in
    assert sum(progress) == SIZE
    assert len(progress) == CHUNKS


def test_reset_reopens_connections(store: Store, make_reader: MakeReader) -> None:
    data = payload()
    reader = make_reader(store.put("model.bin", data))
    assert reader.read(0, CHUNK) == data[:CHUNK]
    reader.reset()
    assert reader.read(CHUNK, SIZE) == data[CHUNK:]


def _client_connections(port: int) -> int:
    import psutil

    connections = psutil.Process().net_connections("tcp")
    return sum(1 for c in connections if c.raddr and c.raddr.port == port)


def test_reset_closes_the_connections(http_store: HttpStore, make_reader: MakeReader) -> None:
    """Before a snapshot the replica resets its readers: no connection may stay open.
    (HTTP only: moto's server closes every connection after its response anyway.)"""
    port = http_store.server.server_address[1]
    reader = make_reader(http_store.put("model.bin", payload()))
    reader.read(0, SIZE)
    assert _client_connections(port) > 0
    reader.reset()
    deadline = time.monotonic() + 5
    while _client_connections(port) and time.monotonic() < deadline:
        time.sleep(0.01)  # the event loop closes sockets a moment after the session
    assert _client_connections(port) == 0


def test_ranges_beyond_the_object_are_refused(file_store: Store, make_reader: MakeReader) -> None:
    url = file_store.put("model.bin", payload())
    reader = make_reader(url)
    for start, end in [(0, SIZE + 1), (-1, 5), (10, 5), (SIZE + 1, SIZE + 1)]:
        with pytest.raises(WeightsFormatError, match=f"beyond the object's {SIZE} bytes") as info:
            reader.read(start, end)
        assert info.value.url == url


def test_unknown_schemes_and_bad_urls_are_refused() -> None:
    with pytest.raises(WeightsError, match="s3://") as info:
        open_origin("ftp://example.test/model.bin")
    assert info.value.url == "ftp://example.test/model.bin"
    with pytest.raises(WeightsError, match="bucket and a key"):
        open_origin("s3://only-a-bucket")


# -- the disk tier across processes ----------------------------------------------------------


@pytest.mark.parametrize("store", ["http", "s3"], indirect=True)
def test_another_process_reads_from_the_disk_cache(
    store: Store, make_reader: MakeReader, disk: DiskCache
) -> None:
    data = payload()
    url = store.put("model.bin", data)
    assert make_reader(url, disk).read(0, SIZE) == data
    [report] = read_in_other_processes(url, disk.root, 1)
    assert report["sha256"] == sha256(data)
    assert report["origin_requests"] == 0
    assert report["disk_hits"] == CHUNKS
    if isinstance(store, HttpStore):
        assert store.server.gets("model.bin") == CHUNKS


def test_two_processes_at_once_fetch_each_chunk_once(http_store: HttpStore, tmp_path: Path) -> None:
    data = payload(8 * CHUNK)
    url = http_store.put("model.bin", data)
    http_store.server.delay_seconds = 0.05  # the slower the origin, the harder the race
    reports = read_in_other_processes(url, tmp_path / "cache", 2)
    assert [report["sha256"] for report in reports] == [sha256(data)] * 2
    asked = [record.range for record in http_store.server.recorded("model.bin")]
    assert len(asked) == len(set(asked)) == 8
    assert sum(report["origin_requests"] for report in reports) == 8
    assert sum(report["disk_hits"] for report in reports) == 8


def _data_file(cache: DiskCache, reader: ObjectReader) -> Path:
    return cache.data_path(DiskCache.key(reader.url, reader.version))


def test_eviction_removes_least_recently_used_objects(
    http_store: HttpStore, make_reader: MakeReader, tmp_path: Path
) -> None:
    objects = {f"model-{number}.bin": payload(2 * CHUNK, seed=number) for number in range(3)}
    urls = {name: http_store.put(name, data) for name, data in objects.items()}
    cache = DiskCache(tmp_path / "cache", 5 * CHUNK)

    def read(name: str) -> ObjectReader:
        # One chunk at a time, so that the recorded total is exact (concurrent writers may
        # count a chunk twice until the next rescan).
        reader = make_reader(urls[name], cache, concurrency=1)
        assert reader.read(0, 2 * CHUNK) == objects[name]
        assert cache.usage() <= 5 * CHUNK
        time.sleep(0.05)  # distinct use times, whatever the file system's timestamp ticks
        return reader

    first, second = read("model-0.bin"), read("model-1.bin")
    # What the node reports, for placement: bytes held by URL.
    assert cache.holdings() == {urls["model-0.bin"]: 2 * CHUNK, urls["model-1.bin"]: 2 * CHUNK}
    read("model-0.bin")  # used again: now model-1 is the least recently used
    third = read("model-2.bin")  # over budget: one whole object must go
    assert not _data_file(cache, second).exists()
    assert not _data_file(cache, second).with_suffix(".chunks").exists()
    assert not _data_file(cache, second).with_suffix(".url").exists()
    assert cache.holdings() == {urls["model-0.bin"]: 2 * CHUNK, urls["model-2.bin"]: 2 * CHUNK}
    # An object whose URL note is gone (its writer died first) is only left out.
    _data_file(cache, third).with_suffix(".url").unlink()
    assert cache.holdings() == {urls["model-0.bin"]: 2 * CHUNK}
    assert make_reader(urls["model-2.bin"], cache).read(0, CHUNK) == objects["model-2.bin"][:CHUNK]
    assert _data_file(cache, first).exists() and _data_file(cache, third).exists()
    assert cache.usage() == 4 * CHUNK
    assert (cache.root / "size").read_text() == str(4 * CHUNK)
    # The kept object comes from disk; the evicted one from the origin again, correctly.
    again = make_reader(urls["model-0.bin"], cache)
    assert again.read(0, 2 * CHUNK) == objects["model-0.bin"]
    assert again.stats()["origin_requests"] == 0
    evicted = make_reader(urls["model-1.bin"], cache)
    assert evicted.read(0, 2 * CHUNK) == objects["model-1.bin"]
    assert evicted.stats()["origin_requests"] == 2
    assert cache.usage() <= 5 * CHUNK


def test_an_object_larger_than_the_budget_stays_in_memory(
    http_store: HttpStore, make_reader: MakeReader, tmp_path: Path
) -> None:
    data = payload(8 * CHUNK)
    cache = DiskCache(tmp_path / "cache", 3 * CHUNK)
    reader = make_reader(http_store.put("model.bin", data), cache)
    assert reader.read(0, 8 * CHUNK) == data
    assert reader.read(0, 8 * CHUNK) == data
    assert reader.stats()["origin_requests"] == 8
    assert cache.usage() == 0


def test_processes_evicting_at_once_stay_within_budget(
    http_store: HttpStore, tmp_path: Path
) -> None:
    objects = {f"model-{number}.bin": payload(2 * CHUNK, seed=number) for number in range(4)}
    root = tmp_path / "cache"
    http_store.server.delay_seconds = 0.01  # long enough for the writers to overlap
    processes = [
        ReaderProcess(http_store.put(name, data), root, budget=3 * CHUNK)
        for name, data in objects.items()
    ]
    for process in processes:
        process.wait_ready()
    for process in processes:
        process.go()
    reports = [process.result() for process in processes]
    assert [report["sha256"] for report in reports] == [sha256(d) for d in objects.values()]
    assert DiskCache(root, 3 * CHUNK).usage() <= 3 * CHUNK


def test_a_chunk_without_its_marker_is_fetched_again(
    http_store: HttpStore, make_reader: MakeReader, disk: DiskCache
) -> None:
    """As a crash between writing a chunk's bytes and marking it would leave it."""
    data = payload()
    url = http_store.put("model.bin", data)
    assert make_reader(url, disk).read(0, SIZE) == data
    reader = make_reader(url, disk)
    path = _data_file(disk, reader)
    marker = path.with_suffix(".chunks") / f"{CHUNK}-{2 * CHUNK}"
    marker.unlink()
    with open(path, "r+b") as file:  # half-written garbage where chunk 1 goes
        file.seek(CHUNK)
        file.write(b"\xff" * (CHUNK // 2))
    assert reader.read(0, SIZE) == data
    assert reader.stats()["origin_requests"] == 1
    asked = [record.range for record in http_store.server.recorded("model.bin")]
    assert asked[-1] == f"bytes={CHUNK}-{2 * CHUNK - 1}"
    assert marker.exists()
    assert path.read_bytes() == data


def test_a_data_file_with_no_markers_is_fetched_whole(
    file_store: Store, make_reader: MakeReader, disk: DiskCache
) -> None:
    data = payload()
    url = file_store.put("model.bin", data)
    first = make_reader(url, disk)
    assert first.read(0, SIZE) == data
    path = _data_file(disk, first)
    shutil.rmtree(path.with_suffix(".chunks"))
    again = make_reader(url, disk)
    assert again.read(0, SIZE) == data
    assert again.stats()["origin_requests"] == CHUNKS


def test_threads_asking_for_one_chunk_produce_it_once(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "cache", BIG_BUDGET)
    version = ObjectVersion(3000, "tag")
    produced: list[int] = []

    def produce(start: int, end: int) -> bytes:
        produced.append(1)
        time.sleep(0.05)
        return b"z" * (end - start)

    # One place per thread, as separate readers in one process would have.
    places = [cache.open("file:///model.bin", version) for _ in range(8)]
    results: list[bytes | None] = []

    def fetch(place: Any) -> None:
        results.extend(place.fetch_run([(1000, 2000)], produce))

    threads = [threading.Thread(target=fetch, args=(place,)) for place in places]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [None] * 8  # all on disk
    assert len(produced) == 1
    for place in places:
        assert place is not None
        assert place.view(1000, 2000, [(1000, 2000)]) == b"z" * 1000
        assert place.view(0, 1000, [(0, 1000)]) is None  # never fetched


def test_an_unusable_cache_only_slows_reads_down(
    file_store: Store, make_reader: MakeReader, tmp_path: Path
) -> None:
    data = payload()
    (tmp_path / "not-a-folder").write_bytes(b"")
    broken = DiskCache(tmp_path / "not-a-folder" / "cache", BIG_BUDGET)
    reader = make_reader(file_store.put("model.bin", data), broken)
    assert reader.read(0, SIZE) == data
    assert reader.stats()["origin_requests"] == CHUNKS


def test_a_version_changes_the_cache_key() -> None:
    first = DiskCache.key("s3://b/k", ObjectVersion(10, '"a"'))
    assert first == DiskCache.key("s3://b/k", ObjectVersion(10, '"a"'))
    assert first != DiskCache.key("s3://b/k", ObjectVersion(10, '"b"'))
    assert first != DiskCache.key("s3://b/k2", ObjectVersion(10, '"a"'))
    assert first != DiskCache.key("s3://b/k", ObjectVersion(11, '"a"'))


# -- versions and errors ---------------------------------------------------------------------


@pytest.mark.parametrize("new_size", [SIZE, SIZE - 100], ids=["same-size", "shorter"])
def test_a_changed_object_is_never_mixed(
    store: Store, make_reader: MakeReader, disk: DiskCache, new_size: int
) -> None:
    old, new = payload(seed=1), payload(new_size, seed=2)
    url = store.put("model.bin", old)
    reader = make_reader(url, disk)
    assert reader.read(0, CHUNK) == old[:CHUNK]
    store.put("model.bin", new)
    with pytest.raises(WeightsChangedError) as info:
        reader.read(CHUNK, 3 * CHUNK)
    assert info.value.url == url
    assert reader.read(0, CHUNK) == old[:CHUNK]  # what it has stays of its own version
    fresh = make_reader(url, disk)
    assert fresh.read(0, new_size) == new
    assert fresh.stats()["disk_hits"] == 0  # the old version's chunks are not reused


def test_missing_objects_are_not_found(store: Store, make_reader: MakeReader) -> None:
    url = store.url("missing.bin")
    with pytest.raises(WeightsNotFoundError) as info:
        make_reader(url).size  # noqa: B018 (the stat is the point)
    assert info.value.url == url
    assert url in str(info.value)


def test_an_object_deleted_after_stat_is_not_found(store: Store, make_reader: MakeReader) -> None:
    url = store.put("model.bin", payload())
    reader = make_reader(url)
    assert reader.size == SIZE
    store.remove("model.bin")
    with pytest.raises(WeightsNotFoundError) as info:
        reader.read(0, CHUNK)
    assert info.value.url == url


def test_a_missing_bucket_is_not_found(aws_env: S3Server, make_reader: MakeReader) -> None:
    with pytest.raises(WeightsNotFoundError):
        make_reader("s3://no-such-bucket-for-weights/model.bin").size  # noqa: B018


def test_s3_refuses_unknown_credentials(
    s3_store: S3Store, aws_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_store.put("model.bin", payload())
    known = open_origin(url).stat()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    aws_env.require_credentials(True)
    try:
        origin = open_origin(url)
        with pytest.raises(WeightsAccessDeniedError) as info:
            origin.stat()
        assert info.value.url == url
        with pytest.raises(WeightsAccessDeniedError):
            origin.read_range(0, CHUNK, known)
    finally:
        aws_env.require_credentials(False)


def test_http_403_is_access_denied(http_store: HttpStore, make_reader: MakeReader) -> None:
    url = http_store.put("secret.bin", payload())
    http_store.server.force("secret.bin", 403)
    with pytest.raises(WeightsAccessDeniedError) as info:
        make_reader(url).size  # noqa: B018
    assert info.value.url == url


def test_transient_503s_are_retried(http_store: HttpStore, make_reader: MakeReader) -> None:
    data = payload()
    reader = make_reader(http_store.put("model.bin", data))
    assert reader.size == SIZE
    http_store.server.fail_next(3, 503)
    assert reader.read(0, SIZE) == data
    assert reader.stats()["origin_requests"] == CHUNKS + 3


def test_persistent_failures_make_the_object_unavailable(
    http_store: HttpStore, make_reader: MakeReader
) -> None:
    url = http_store.put("model.bin", payload())
    reader = make_reader(url, retries=2)
    assert reader.size == SIZE
    http_store.server.force("model.bin", 503)
    with pytest.raises(WeightsUnavailableError, match="503") as info:
        reader.read(0, CHUNK)
    assert info.value.url == url
    assert reader.stats()["origin_requests"] == 3


def test_a_truncated_response_is_retried_then_unavailable(
    http_store: HttpStore, make_reader: MakeReader
) -> None:
    data = payload()
    url = http_store.put("model.bin", data)
    reader = make_reader(url, retries=2)
    assert reader.size == SIZE
    http_store.server.cut_next(1, after_bytes=1000)
    assert reader.read(0, CHUNK) == data[:CHUNK]
    assert reader.stats()["origin_requests"] == 2
    http_store.server.cut_next(3, after_bytes=1000)
    with pytest.raises(WeightsUnavailableError) as info:
        reader.read(CHUNK, 2 * CHUNK)
    assert info.value.url == url


def test_an_unreachable_server_is_unavailable(make_reader: MakeReader) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/model.bin"
    with pytest.raises(WeightsUnavailableError) as info:
        make_reader(url, retries=1).size  # noqa: B018
    assert info.value.url == url


# -- S3 specifics ----------------------------------------------------------------------------


def test_s3_endpoint_from_the_argument_and_one_get_per_chunk(
    s3_store: S3Store, aws_env: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    data = payload()
    url = s3_store.put("model.bin", data)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    gets: list[str] = []

    def client() -> Any:
        made = boto3.session.Session().client("s3", endpoint_url=aws_env.endpoint_url)
        made.meta.events.register(
            "before-send.s3.GetObject", lambda request, **_: gets.append(request.url)
        )
        return made

    origin = S3Origin(url, client_factory=client)
    with ObjectReader(origin, None, options()) as reader:
        assert reader.read(0, SIZE) == data
        assert len(gets) == origin.requests == CHUNKS
        reader.reset()
        assert reader.read(0, SIZE) == data  # from memory: no new client needed
    assert len(gets) == CHUNKS
    explicit = open_origin(url, s3_endpoint_url=aws_env.endpoint_url)
    assert explicit.stat().size == SIZE
    explicit.reset()
    assert explicit.read_range(0, 10, explicit.stat()) == data[:10]


def test_file_urls_read_local_files(tmp_path: Path) -> None:
    path = tmp_path / "weights dir" / "model.bin"
    path.parent.mkdir()
    data = payload()
    path.write_bytes(data)
    origin = open_origin(path.as_uri())
    version = origin.stat()
    assert version.size == SIZE
    assert origin.read_range(5, 70_000, version) == data[5:70_000]
    assert isinstance(origin, FileOrigin)
    assert origin.path == os.fspath(path)  # the %20 of the URL decoded


def test_large_ranges_come_in_buffers_of_their_own(store: Store) -> None:
    """A range of 1 MiB or more is read into an anonymous mapping (range_buffers), exactly."""
    import mmap

    data = random.Random(5).randbytes(3 * 2**20 + 17)
    origin = open_origin(store.put("large.bin", data))
    version = origin.stat()
    whole = origin.read_range(0, len(data), version)
    assert isinstance(whole, mmap.mmap) and bytes(whole) == data
    part = origin.read_range(2**20 - 5, 3 * 2**20, version)
    assert bytes(part) == data[2**20 - 5 : 3 * 2**20]
    assert origin.read_range(7, 100, version) == data[7:100]


def test_a_cache_file_cut_short_is_replaced_not_read_around_for_ever(
    file_store: Store, tmp_path: Path, make_reader: MakeReader
) -> None:
    data = payload()
    url = file_store.put("model.bin", data)
    root = tmp_path / "cache"
    assert make_reader(url, DiskCache(root, BIG_BUDGET)).read(0, SIZE) == data
    [cached] = root.rglob("*.data")
    os.truncate(cached, SIZE // 2)  # damaged behind the cache's back
    # The next reader still gets the right bytes, and the damaged file goes ...
    assert make_reader(url, DiskCache(root, BIG_BUDGET)).read(0, SIZE) == data
    # ... so that the one after reads it all from the disk again.
    last = make_reader(url, DiskCache(root, BIG_BUDGET))
    assert last.read(0, SIZE) == data
    assert last.stats()["origin_requests"] == 0
    assert [path.stat().st_size for path in root.rglob("*.data")] == [SIZE]
