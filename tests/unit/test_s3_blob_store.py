"""Both blob stores keep one contract: the local folder, and an S3 bucket served by moto
in server mode (a real S3 API over HTTP on loopback). Then what only S3 has: multipart
uploads that leave nothing behind when refused, deletes that return at once and still
land before a later put of the key, and a bucket that cannot be used."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember_platform.config import ServerConfig
from ember_platform.storage.blobs import BlobStore, LocalBlobStore
from ember_platform.storage.s3_blobs import PART_BYTES, BlobStoreError, S3BlobStore, parse_s3_url
from ember_platform.store_opening import open_blob_store

BUCKET = "ember-blobs"
CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_client(s3_endpoint: str) -> Any:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, **CREDENTIALS)
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def s3_store(s3_client: Any, request: pytest.FixtureRequest) -> Iterator[S3BlobStore]:
    prefix = request.node.name.replace("[", "-").replace("]", "")[:60]
    store = S3BlobStore(f"s3://{BUCKET}/{prefix}", client=s3_client)
    yield store
    store.close()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    s3: S3BlobStore = request.getfixturevalue("s3_store")
    return s3


async def stream(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def objects(client: Any, store: S3BlobStore) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=store.prefix)
    return [o["Key"].removeprefix(store.prefix) for o in listing.get("Contents", [])]


def test_put_get_open_exists_delete(store: BlobStore) -> None:
    assert store.get("bundles/a") is None
    assert store.open("bundles/a") is None
    assert not store.exists("bundles/a")
    store.put("bundles/a", b"bundle bytes")
    assert store.exists("bundles/a")
    assert store.get("bundles/a") == b"bundle bytes"
    handle = store.open("bundles/a")
    assert handle is not None
    with handle:
        assert handle.read(6) + handle.read() == b"bundle bytes"
    store.put("bundles/a", b"replaced")
    assert store.get("bundles/a") == b"replaced"
    store.delete("bundles/a")
    store.delete("bundles/never-there")  # not an error
    store.close()  # the deletes have landed
    assert store.get("bundles/a") is None


def test_rename_moves_the_content_over_what_the_new_key_held(store: BlobStore) -> None:
    store.put("volumes/uploads/u1", b"new content")
    store.put("volumes/sha256-x", b"old content")
    store.rename("volumes/uploads/u1", "volumes/sha256-x")
    assert store.get("volumes/sha256-x") == b"new content"
    assert not store.exists("volumes/uploads/u1")


def test_a_listing_gives_a_folders_keys_with_their_write_times(store: BlobStore) -> None:
    before = time.time() - 5
    store.put("volumes/uploads/u2", b"b")
    store.put("volumes/uploads/u1", b"a")
    store.put("volumes/sha256-x", b"c")
    store.close()
    listed = store.listing("volumes/uploads/")
    assert [key for key, _ in listed] == ["volumes/uploads/u1", "volumes/uploads/u2"]
    assert all(before < written < time.time() + 5 for _, written in listed)
    assert [key for key, _ in store.listing("volumes/")] == [
        "volumes/sha256-x",
        "volumes/uploads/u1",
        "volumes/uploads/u2",
    ]
    assert store.listing("snapshots/") == []


@pytest.mark.parametrize("size", [0, 1000, PART_BYTES, 2 * PART_BYTES + 12345])
def test_a_streamed_blob_arrives_whole(store: BlobStore, size: int) -> None:
    data = os.urandom(size)
    chunks = [data[i : i + 1_000_000] for i in range(0, size, 1_000_000)]
    assert asyncio.run(store.put_chunks("snapshots/k", stream(chunks), limit=64 << 20)) == size
    assert store.get("snapshots/k") == data


def test_a_blob_over_its_limit_is_refused_and_leaves_nothing(store: BlobStore) -> None:
    chunks = [b"x" * PART_BYTES, b"y" * PART_BYTES, b"z" * 10]
    with pytest.raises(ValueError, match="over the limit"):
        asyncio.run(store.put_chunks("snapshots/k", stream(chunks), limit=2 * PART_BYTES))
    assert not store.exists("snapshots/k")


def test_a_refused_multipart_upload_is_aborted(s3_store: S3BlobStore, s3_client: Any) -> None:
    chunks = [b"x" * PART_BYTES, b"y" * PART_BYTES, b"z" * 10]
    with pytest.raises(ValueError):
        asyncio.run(s3_store.put_chunks("snapshots/k", stream(chunks), limit=2 * PART_BYTES))
    uploads = s3_client.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_store.prefix)
    assert uploads.get("Uploads", []) == []  # no parts left to pay for
    assert objects(s3_client, s3_store) == []


def test_a_stream_that_fails_midway_leaves_nothing(s3_store: S3BlobStore, s3_client: Any) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * (PART_BYTES + 1)
        raise ConnectionResetError("the worker went away")

    with pytest.raises(ConnectionResetError):
        asyncio.run(s3_store.put_chunks("snapshots/k", broken(), limit=1 << 30))
    uploads = s3_client.list_multipart_uploads(Bucket=BUCKET, Prefix=s3_store.prefix)
    assert uploads.get("Uploads", []) == []
    assert objects(s3_client, s3_store) == []


class SlowDeletes:
    """The client, with deletes that take their time (a slow or distant bucket)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def delete_object(self, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return self.client.delete_object(**kwargs)


def test_a_delete_lands_before_a_later_put_of_the_key(s3_client: Any) -> None:
    """An image dropped and retaken under the same key: the drop's delete returns at once
    and must not land after the new image, however slow it is."""
    s3_store = S3BlobStore(f"s3://{BUCKET}/ordering", client=SlowDeletes(s3_client))
    s3_store.put("snapshots/k", b"old image")
    s3_store.delete("snapshots/k")
    size = asyncio.run(s3_store.put_chunks("snapshots/k", stream([b"new image"]), 1 << 20))
    assert size == 9
    s3_store.delete("volumes/a")
    s3_store.put("volumes/a", b"again")
    s3_store.close()
    time.sleep(0.5)  # past the slow delete, wherever it ran
    assert s3_client.get_object(Bucket=BUCKET, Key=s3_store.prefix + "snapshots/k")[
        "Body"
    ].read() == (b"new image")
    assert objects(s3_client, s3_store) == ["snapshots/k", "volumes/a"]


def test_keys_are_checked(store: BlobStore) -> None:
    for key in ("../etc/passwd", "/abs", "a/../b", ""):
        with pytest.raises(ValueError, match="invalid blob key"):
            store.put(key, b"x")


def test_a_bucket_that_is_not_there_is_named(s3_client: Any) -> None:
    with pytest.raises(BlobStoreError, match=r"s3://no-such-bucket.*is the bucket there"):
        S3BlobStore("s3://no-such-bucket/x", client=s3_client).check()


def test_a_bucket_that_stops_answering_fails_the_call_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that takes the connection and never answers: the call ends at its read
    timeout, and says so."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = S3BlobStore(f"s3://{BUCKET}", endpoint_url=url, read_timeout=0.5, max_attempts=2)
        try:
            with pytest.raises(BlobStoreError, match="timeout"):
                store.check()
        finally:
            store.close()


def test_the_default_client_gives_up_on_a_silent_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = S3BlobStore(f"s3://{BUCKET}", endpoint_url="http://127.0.0.1:9")
    try:
        config = store.client.meta.config
        assert (config.connect_timeout, config.read_timeout) == (5.0, 20.0)
        assert config.retries["total_max_attempts"] == 3  # tries, the first included
    finally:
        store.close()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://b", ("b", "")),
        ("s3://b/", ("b", "")),
        ("s3://b/ember", ("b", "ember/")),
        ("s3://b/a/b/", ("b", "a/b/")),
    ],
)
def test_s3_urls(url: str, expected: tuple[str, str]) -> None:
    assert parse_s3_url(url) == expected


@pytest.mark.parametrize("url", ["b/x", "s3://", "s3:///x", "https://b/x"])
def test_what_is_not_an_s3_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="s3://BUCKET"):
        parse_s3_url(url)


def test_a_server_moving_to_a_bucket_is_told_of_the_blobs_it_kept_before(
    tmp_path: Path,
    s3_endpoint: str,
    s3_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://{BUCKET}/moved"
    config = ServerConfig(state_dir=tmp_path, blob_store=url, blob_s3_endpoint_url=s3_endpoint)
    with caplog.at_level(logging.WARNING):
        open_blob_store(config).close()
    assert "blobs kept before" not in caplog.text  # nothing there: nothing to say
    LocalBlobStore(config.blob_dir).put("bundles/sha256-aa", b"an old bundle")
    with caplog.at_level(logging.WARNING):
        store = open_blob_store(config)
    store.close()
    assert isinstance(store, S3BlobStore)
    told = "holds blobs kept before --blob-store: copy them into the bucket (aws s3 sync"
    assert f"{told} {config.blob_dir} {url})" in caplog.text


def test_a_direct_url_reads_the_blob_from_the_bucket_itself(
    s3_store: S3BlobStore, tmp_path: Path
) -> None:
    import httpx

    s3_store.put("snapshots/k", b"an image")
    direct = s3_store.direct_url("snapshots/k")
    assert direct is not None
    got = httpx.get(direct)
    assert got.status_code == 200 and got.content == b"an image"
    missing = s3_store.direct_url("snapshots/none")
    assert missing is not None and httpx.get(missing).status_code == 404
    assert LocalBlobStore(tmp_path).direct_url("snapshots/k") is None  # only via the server
