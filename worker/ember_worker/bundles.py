"""The node's bundle cache: each app bundle is downloaded and extracted once per node."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx

from ember.errors import BundleError
from ember.tlsclient import client_context
from ember_worker.bundle_extract import extract_bundle


class BundleCache:
    def __init__(self, root: Path, server_url: str, token: str, ca_cert: str | None) -> None:
        self.root = root
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.ca_cert = ca_cert
        self._locks: dict[str, asyncio.Lock] = {}
        root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.root / digest.replace(":", "-")

    def cached(self) -> list[str]:
        return [
            p.name.replace("-", ":", 1) for p in self.root.iterdir() if p.name.startswith("sha256-")
        ]

    async def ensure(self, digest: str) -> Path:
        dest = self.path(digest)
        if dest.exists():
            return dest
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:
            if dest.exists():
                return dest
            async with httpx.AsyncClient(
                verify=client_context(self.ca_cert), timeout=120
            ) as client:
                response = await client.get(
                    f"{self.server_url}/v1/bundles/{digest}",
                    headers={"Authorization": f"Bearer {self.token}"},
                )
            if response.status_code != 200:
                raise BundleError(f"cannot fetch bundle {digest}: HTTP {response.status_code}")
            data = response.content
            if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                raise BundleError(f"bundle {digest} arrived corrupted (digest mismatch)")
            await asyncio.to_thread(extract_bundle, data, dest)
            return dest
