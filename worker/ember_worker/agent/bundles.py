"""The node's bundle cache: each app bundle is downloaded and extracted once per node.

What was extracted is recorded beside its folder (`sha256-<hex>.files.json`: each file's
path, size and sha256). Before every start the folder is checked against it: one that
changed is moved aside, removed, and extracted again from a fresh download. Folders no
replica uses (starting or running) go, the least recently used first, once the
extracted total passes the budget (`--bundle-cache-gb`). A snapshot image maps bundle
files by path, but a restore calls ensure() first, which extracts a removed folder
again at the same path: images do not keep folders.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ember.calling.tlsclient import client_context
from ember.errors import BundleError
from ember_worker.agent.bundle_extract import Listing, extract_listed

log = logging.getLogger("ember.worker")

# A control plane that cannot reach its blob store for a moment answers 503 (502 and 504
# come from proxies in front of it): the download is tried again for about a minute, so
# that a short outage delays a replica's start instead of failing it.
RETRIED_STATUSES = (502, 503, 504)
RETRY_FOR_S = 60.0
FIRST_PAUSE_S = 0.5
LONGEST_PAUSE_S = 8.0
LISTING_SUFFIX = ".files.json"
DEFAULT_BUDGET_BYTES = 2 * 1024**3
_HASH_CHUNK = 1024 * 1024


def _server_reason(response: httpx.Response) -> str:
    """The message of the platform's JSON error, or the status alone."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"
    return f"HTTP {response.status_code}: {message}"


class BundleCache:
    def __init__(
        self,
        root: Path,
        server_url: str,
        token: str,
        ca_cert: str | None,
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        in_use: Callable[[], set[str]] = set,
    ) -> None:
        self.root = root
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.ca_cert = ca_cert
        self.budget_bytes = budget_bytes
        self.in_use = in_use  # digests of the replicas starting or running here: kept
        self._locks: dict[str, asyncio.Lock] = {}
        self._sizes: dict[str, int] = {}  # bytes extracted, by digest, read from listings
        self._removals: set[asyncio.Task[list[str]]] = set()
        root.mkdir(parents=True, exist_ok=True)

    async def _download(self, digest: str) -> bytes:
        headers = {"Authorization": f"Bearer {self.token}"}
        deadline = asyncio.get_running_loop().time() + RETRY_FOR_S
        pause = FIRST_PAUSE_S
        async with httpx.AsyncClient(verify=client_context(self.ca_cert), timeout=120) as client:
            while True:
                # Read each try: a session that moved along the --server list moves it.
                url = f"{self.server_url}/v1/bundles/{digest}"
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

    def listing_path(self, digest: str) -> Path:
        """The record of what was extracted: beside the folder, not in it."""
        return self.root / (digest.replace(":", "-") + LISTING_SUFFIX)

    def cached(self) -> list[str]:
        """The digests extracted here (folder and record)."""
        return [
            p.name.replace("-", ":", 1)
            for p in self.root.iterdir()
            if p.name.startswith("sha256-") and p.is_dir() and self.listing_path(p.name).exists()
        ]

    async def ensure(self, digest: str) -> Path:
        """The bundle's folder, checked against what was extracted there (extracted again
        from a fresh download if it changed), then the budget kept."""
        dest = self.path(digest)
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:
            problem = await asyncio.to_thread(self._changed, digest)
            if problem is None:
                _touch(self.listing_path(digest))  # recently used: the last to go
            else:
                if os.path.lexists(dest):
                    log.warning(
                        "bundle %s: its extracted folder %s; moved aside and removed, "
                        "extracting it again from a fresh download",
                        digest,
                        problem,
                    )
                await self._discard(digest)
                data = await self._download(digest)
                if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                    raise BundleError(f"bundle {digest} arrived corrupted (digest mismatch)")
                _, listing = await asyncio.to_thread(extract_listed, data, dest)
                # The workspace's replica user is let in by name (replica_access.py).
                os.chmod(dest, 0o700)
                self._sizes[digest] = await asyncio.to_thread(self._record, digest, listing)
        await self.trim(keep=digest)
        return dest

    def _record(self, digest: str, listing: Listing) -> int:
        """Write the listing beside the folder (atomically); return the bytes it lists."""
        size = sum(size for size, _ in listing.values())
        path = self.listing_path(digest)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # root's alone
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps({"size": size, "files": listing}, sort_keys=True))
        os.replace(tmp, path)
        _touch(path)
        return size

    def _listing(self, digest: str) -> tuple[int, Listing] | None:
        try:
            data = json.loads(self.listing_path(digest).read_text())
            files = {str(k): (int(v[0]), str(v[1])) for k, v in data["files"].items()}
            return int(data["size"]), files
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None

    def _changed(self, digest: str) -> str | None:
        """How the folder differs from its record (None: it holds exactly those files,
        with those contents). Links and special files count as changes."""
        dest = self.path(digest)
        recorded = self._listing(digest)
        if recorded is None:
            return "has no readable record of what was extracted"
        expected = recorded[1]
        if dest.is_symlink() or (os.path.lexists(dest) and not dest.is_dir()):
            return "is not a folder"
        if not dest.is_dir():
            return "is missing"
        seen = 0
        for dirpath, dirs, files in os.walk(dest):
            for name in [*dirs, *files]:
                path = Path(dirpath, name)
                relative = path.relative_to(dest).as_posix()
                if path.is_symlink():
                    return f"holds a link, '{relative}'"
                if name in dirs:
                    continue
                if not path.is_file():
                    return f"holds '{relative}', which is not a regular file"
                if relative not in expected:
                    return f"holds '{relative}', which the bundle does not"
                size, sha256 = expected[relative]
                if _file_sha256(path, size) != sha256:
                    return f"has '{relative}' changed"
                seen += 1
        if seen != len(expected):
            return f"lacks {len(expected) - seen} of the bundle's files"
        return None

    async def _discard(self, digest: str) -> None:
        """Forget the bundle here: its record first, then its folder, moved aside (at
        once, so a start never finds it half removed) and removed."""
        self._sizes.pop(digest, None)
        self.listing_path(digest).unlink(missing_ok=True)
        dest = self.path(digest)
        if not os.path.lexists(dest):
            return
        aside = dest.with_name(f".{dest.name}.removed-{secrets.token_hex(4)}")
        os.replace(dest, aside)
        if aside.is_symlink() or not aside.is_dir():  # put there in the folder's place
            aside.unlink()
        else:
            await asyncio.to_thread(shutil.rmtree, aside, True)

    def _size(self, digest: str) -> int:
        size = self._sizes.get(digest)
        if size is None:
            recorded = self._listing(digest)
            size = recorded[0] if recorded is not None else 0
            self._sizes[digest] = size
        return size

    async def trim(self, keep: str | None = None) -> list[str]:
        """Past the budget, remove the least recently used folders that no replica uses
        (nor `keep`, nor one being checked or extracted). Return their digests."""
        entries = []
        for folder in self.root.iterdir():
            if not folder.name.startswith("sha256-") or not folder.is_dir():
                continue
            digest = folder.name.replace("-", ":", 1)
            try:
                used_at = self.listing_path(digest).stat().st_mtime
            except FileNotFoundError:
                used_at = 0.0  # no record (a crash, an older worker): it cannot be checked
            entries.append((used_at, digest))
        total = sum(self._size(digest) for _, digest in entries)
        if total <= self.budget_bytes and all(used_at for used_at, _ in entries):
            return []
        removed = []
        for used_at, digest in sorted(entries):
            if total <= self.budget_bytes and used_at:
                break
            # Asked again at each: a start may have begun while the last one was removed.
            # From here to the folder's move aside, nothing awaits.
            if digest == keep or digest in self.in_use() or self._locked(digest):
                continue
            size = self._size(digest)
            await self._discard(digest)
            total -= size
            removed.append(digest)
        if removed:
            log.info(
                "removed %d extracted bundle(s) no replica uses, to keep within "
                "--bundle-cache-gb=%g: %s",
                len(removed),
                self.budget_bytes / 1e9,
                ", ".join(removed),
            )
        return removed

    def _locked(self, digest: str) -> bool:
        lock = self._locks.get(digest)
        return lock is not None and lock.locked()

    def trim_soon(self) -> None:
        """trim() in the background (a replica ended: its bundle may be unused now)."""
        task = asyncio.ensure_future(self.trim())
        self._removals.add(task)  # keep a reference until it is done
        task.add_done_callback(self._removals.discard)


def _touch(path: Path) -> None:
    """Mark as used now: by the clock, finer than the kernel's file timestamps."""
    now = time.time()
    os.utime(path, (now, now))


def _file_sha256(path: Path, size: int) -> str | None:
    """The file's sha256, or None where its size is not `size` (not read then)."""
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != size:
                return None
            digest = hashlib.sha256()
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
            return digest.hexdigest()
    except OSError:
        return None
