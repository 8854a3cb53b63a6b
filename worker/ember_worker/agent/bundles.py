"""The node's bundle cache: each app bundle is downloaded and extracted once per node."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx

from ember.calling.tlsclient import client_context
from ember.errors import BundleError
from ember_worker.agent.bundle_extract import extract_bundle

# A control plane that cannot reach its blob store for a moment answers 503 (502 and 504
# come from proxies in front of it): the download is tried again for about a minute, so
# that a short outage delays a replica's start instead of failing it.
RETRIED_STATUSES = (502, 503, 504)
RETRY_FOR_S = 60.0
FIRST_PAUSE_S = 0.5
LONGEST_PAUSE_S = 8.0


def _server_reason(response: httpx.Response) -> str:
    """The message of the platform's JSON error, or the status alone."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"
    return f"HTTP {response.status_code}: {message}"


class BundleCache:
    def __init__(self, root: Path, server_url: str, token: str, ca_cert: str | None) -> None:
        self.root = root
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.ca_cert = ca_cert
        self._locks: dict[str, asyncio.Lock] = {}
        root.mkdir(parents=True, exist_ok=True)

    async def _download(self, digest: str) -> bytes:
        url = f"{self.server_url}/v1/bundles/{digest}"
        headers = {"Authorization": f"Bearer {self.token}"}
        deadline = asyncio.get_running_loop().time() + RETRY_FOR_S
        pause = FIRST_PAUSE_S
        async with httpx.AsyncClient(verify=client_context(self.ca_cert), timeout=120) as client:
            while True:
                try:
                    response = await client.get(url, headers=headers)
                except httpx.TransportError as exc:
                    problem = f"the control plane is unreachable ({type(exc).__name__}: {exc})"
                else:
                    if response.status_code == 200:
                        return response.content
                    problem = _server_reason(response)
                    if response.status_code not in RETRIED_STATUSES:
                        raise BundleError(f"cannot fetch bundle {digest}: {problem}")
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise BundleError(
                        f"cannot fetch bundle {digest}: {problem} (tried for {RETRY_FOR_S:.0f} s)"
                    )
                await asyncio.sleep(pause)
                pause = min(pause * 2, LONGEST_PAUSE_S)

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
            data = await self._download(digest)
            if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                raise BundleError(f"bundle {digest} arrived corrupted (digest mismatch)")
            await asyncio.to_thread(extract_bundle, data, dest)
            return dest
