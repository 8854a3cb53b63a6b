"""Layer tars read by byte range from the control plane's store (`/v1/image-blobs/`,
with the worker's token), as a weights origin: the lazy image file system reads them
through the same `ObjectReader` and node disk cache as weights. A store in a bucket
answers a range with a redirect to the bucket itself, which httpx follows without the
token. A tar is named by its sha256 and never changes: its version is that digest, and
its name in the disk cache `ember-image-blob:<sha256>`, whichever server answers: a
platform of several control-plane processes shares one store, so a read that finds its
server gone (a connection refused, a 502 or 503) is retried on the next of the list."""

from __future__ import annotations

import threading

import httpx

from ember.calling.tlsclient import client_context
from ember.errors import WeightsNotFoundError, WeightsUnavailableError
from ember_worker.weights.origins.origin import (
    CountedOrigin,
    FirstByte,
    ObjectVersion,
    TransientOriginError,
)
from ember_worker.weights.origins.range_buffers import RangeBytes


class StoreConnection:
    """One HTTP client for every layer tar of a mount (thread-safe, kept alive), and the
    servers it may ask, the one in use first."""

    def __init__(self, server_urls: list[str], token: str, ca_cert: str | None) -> None:
        self._bases = [url.rstrip("/") for url in server_urls if url.strip()]
        if not self._bases:
            raise ValueError("a store connection needs a server")
        self._settings = (token, ca_cert)
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    def client(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                token, ca_cert = self._settings
                self._client = httpx.Client(
                    verify=client_context(ca_cert),
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=httpx.Timeout(30.0, read=120.0),
                    follow_redirects=True,
                    limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
                )
            return self._client

    @property
    def base(self) -> str:
        with self._lock:
            return self._bases[0]

    def move_on(self, failed: str) -> None:
        """`failed` did not answer: the next server is asked from now on."""
        with self._lock:
            if len(self._bases) > 1 and self._bases[0] == failed:
                self._bases.append(self._bases.pop(0))

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class LayerBlobOrigin(CountedOrigin):
    def __init__(self, connection: StoreConnection, sha256: str, size: int) -> None:
        super().__init__(f"ember-image-blob:{sha256}")  # its name in the disk cache
        self._connection = connection
        self._path = f"/v1/image-blobs/sha256:{sha256}"
        self._version = ObjectVersion(size=size, tag=sha256)

    def stat(self) -> ObjectVersion:
        return self._version  # known from the index: nothing to ask

    def read_range(
        self,
        start: int,
        end: int,
        version: ObjectVersion,
        *,
        on_first_byte: FirstByte | None = None,
    ) -> RangeBytes:
        if start == end:
            return b""
        self._count_read()
        base = self._connection.base
        try:
            response = self._connection.client().get(
                base + self._path, headers={"Range": f"bytes={start}-{end - 1}"}
            )
        except httpx.TransportError as error:  # retried, on the next server if any
            self._connection.move_on(base)
            raise TransientOriginError(f"{type(error).__name__}: {error}") from error
        except httpx.HTTPError as error:
            raise TransientOriginError(f"{type(error).__name__}: {error}") from error
        if on_first_byte is not None:
            on_first_byte()
        if response.status_code == 404:
            raise WeightsNotFoundError(self.url, "the store has no such layer tar")
        if response.status_code >= 500:
            if response.status_code in (502, 503):  # not serving (a fenced owner, a stop)
                self._connection.move_on(base)
            raise TransientOriginError(f"HTTP {response.status_code}")
        if response.status_code != 206:
            raise WeightsUnavailableError(
                self.url, f"HTTP {response.status_code} to a range request"
            )
        return self._deliver(response.content, start, end)

    def reset(self) -> None:
        self._connection.close()
