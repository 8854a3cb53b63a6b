"""The control plane's store of built images, as a worker reaches it (worker token):
layer tars by their sha256, layers by their digest (each naming its tar), and image
records. Blocking calls: the builder runs in a thread of its own."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from ember.calling.tlsclient import client_context


class LayerStoreError(Exception):
    pass


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(4 * 1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


class LayerStore:
    def __init__(self, server_url: str, token: str, ca_cert: str | None) -> None:
        self.client = httpx.Client(
            base_url=server_url.rstrip("/"),
            verify=client_context(ca_cert),
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(60.0, read=600.0),
        )

    @property
    def server_url(self) -> str:
        return str(self.client.base_url).rstrip("/")

    @server_url.setter
    def server_url(self, url: str) -> None:
        """Another control-plane process of the platform (the worker's session moved)."""
        self.client.base_url = httpx.URL(url.rstrip("/"))

    def close(self) -> None:
        self.client.close()

    def _json(self, path: str) -> dict[str, Any] | None:
        try:
            response = self.client.get(path)
        except httpx.HTTPError as exc:
            raise LayerStoreError(f"GET {path}: {exc}") from None
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise LayerStoreError(f"GET {path}: HTTP {response.status_code} {response.text[:200]}")
        data = response.json()
        return data if isinstance(data, dict) else None

    def _put(self, path: str, **kwargs: Any) -> None:
        try:
            response = self.client.put(path, **kwargs)
        except httpx.HTTPError as exc:
            raise LayerStoreError(f"PUT {path}: {exc}") from None
        if response.status_code != 201:
            raise LayerStoreError(f"PUT {path}: HTTP {response.status_code} {response.text[:200]}")

    def layer(self, digest: str) -> dict[str, Any] | None:
        """A built layer's entry (its tar's sha256 and size, its kind), or None."""
        return self._json(f"/v1/image-layers/{digest}")

    def record(self, digest: str) -> dict[str, Any] | None:
        return self._json(f"/v1/images/{digest}")

    def put_layer(
        self, digest: str, kind: str, archive: Path, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Upload the layer's tar (by its content), then the layer's entry (with `extra`:
        a registry image's env and workdir)."""
        sha256, size = file_sha256(archive), archive.stat().st_size

        def chunks() -> Iterator[bytes]:
            with archive.open("rb") as handle:
                while chunk := handle.read(4 * 1024 * 1024):
                    yield chunk

        self._put(f"/v1/image-blobs/sha256:{sha256}", content=chunks())
        entry = {"sha256": sha256, "size": size, "kind": kind, **(extra or {})}
        self._put(f"/v1/image-layers/{digest}", content=json.dumps(entry))
        return entry

    def put_record(self, digest: str, record: dict[str, Any]) -> None:
        self._put(f"/v1/images/{digest}", content=json.dumps(record))

    def fetch_tar(self, sha256: str, archive: Path) -> None:
        """A layer's tar into `archive`, checked against its sha256."""
        self._fetch(f"/v1/image-blobs/sha256:{sha256}", sha256, archive)

    def fetch_files(self, sha256: str, archive: Path) -> None:
        """The tar of a copy step's files, as the deploying client uploaded it."""
        self._fetch(f"/v1/image-files/sha256:{sha256}", sha256, archive)

    def _fetch(self, path: str, sha256: str, archive: Path) -> None:
        digest = hashlib.sha256()
        try:
            with self.client.stream("GET", path) as response, archive.open("wb") as out:
                if response.status_code != 200:
                    raise LayerStoreError(f"GET {path}: HTTP {response.status_code}")
                for chunk in response.iter_bytes(4 * 1024 * 1024):
                    digest.update(chunk)
                    out.write(chunk)
        except httpx.HTTPError as exc:
            raise LayerStoreError(f"GET {path}: {exc}") from None
        if digest.hexdigest() != sha256:
            raise LayerStoreError(f"{path} arrived with another sha256")
