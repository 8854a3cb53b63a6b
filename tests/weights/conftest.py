"""Fixtures of the weights tests: the servers, AWS settings pointing at moto, and one
`Store` per origin kind that puts objects where a URL can name them."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from .servers import RangeServer, S3Server


class Store(Protocol):
    kind: str

    def put(self, name: str, data: bytes) -> str:
        """Write (or rewrite) an object; returns its URL."""
        ...

    def url(self, name: str) -> str: ...

    def remove(self, name: str) -> None: ...


class _Clock:
    """Strictly increasing modification times: a rewrite within the file system's timestamp
    granularity would otherwise keep the old mtime, hence the old version tag."""

    def __init__(self) -> None:
        self._last = time.time_ns()

    def touch(self, path: Path) -> None:
        self._last = max(self._last + 1_000_000_000, time.time_ns())
        os.utime(path, ns=(self._last, self._last))


class FileStore:
    kind = "file"

    def __init__(self, root: Path) -> None:
        self.root = root
        self._clock = _Clock()
        root.mkdir(parents=True, exist_ok=True)

    def put(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self._clock.touch(path)
        return self.url(name)

    def url(self, name: str) -> str:
        return (self.root / name).as_uri()

    def remove(self, name: str) -> None:
        (self.root / name).unlink()


class HttpStore(FileStore):
    kind = "http"

    def __init__(self, server: RangeServer) -> None:
        super().__init__(server.root)
        self.server = server

    def url(self, name: str) -> str:
        return self.server.url(name)


class S3Store:
    kind = "s3"

    def __init__(self, client: Any, bucket: str) -> None:
        self.client = client
        self.bucket = bucket

    def put(self, name: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.bucket, Key=name, Body=data)
        return self.url(name)

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def remove(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=name)


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[RangeServer]:
    root = tmp_path / "www"
    root.mkdir()
    server = RangeServer(root)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_server: S3Server) -> S3Server:
    """Fake credentials and moto's endpoint through the usual AWS variables (child processes
    inherit them); the machine's own ~/.aws stays out of it."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    return s3_server


@pytest.fixture
def s3_store(aws_env: S3Server) -> Iterator[S3Store]:
    import boto3

    client = boto3.session.Session().client("s3")
    bucket = f"weights-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield S3Store(client, bucket)
    client.close()


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "files")


@pytest.fixture
def http_store(http_server: RangeServer) -> HttpStore:
    return HttpStore(http_server)


@pytest.fixture(params=["file", "http", "s3"])
def store(request: pytest.FixtureRequest) -> Store:
    """Each test using it runs against a local file, the HTTP server and moto's S3."""
    found: Store = request.getfixturevalue(f"{request.param}_store")
    return found
