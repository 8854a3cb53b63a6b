"""Blob stores hold app bundles, snapshot images and volume files, addressed by key: a
local folder by default (`LocalBlobStore`), or an S3 bucket (`s3_blobs.S3BlobStore`).

Their calls block: callers on the event loop run them in a thread, except `delete`,
which may return before it lands (but lands before any later change of the key)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

KEY_PATTERN = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,200}(/[A-Za-z0-9][A-Za-z0-9._:-]{0,200})*$"
)


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...

    async def put_chunks(self, key: str, chunks: AsyncIterator[bytes], limit: int) -> int:
        """Store a large blob as it streams in; returns its size. Over `limit`: ValueError."""
        ...

    def get(self, key: str) -> bytes | None: ...

    def open(self, key: str) -> BinaryIO | None: ...

    def exists(self, key: str) -> bool: ...

    def direct_url(self, key: str) -> str | None:
        """A URL a node may GET the blob from itself, bypassing this server (None: ask
        this server)."""
        ...

    def delete(self, key: str) -> None: ...

    def delete_outcomes(self) -> list[tuple[str, bool]]:
        """(key, deleted) of each delete that landed since the last call, in order, for
        a store whose deletes land in the background; [] for one whose deletes land (or
        raise) before `delete` returns."""
        ...

    def listing(self, prefix: str) -> list[tuple[str, float]]:
        """(key, when it was last written, Unix time) of the blobs whose keys begin with
        `prefix`, a folder's (ending in "/"), by key."""
        ...

    def rename(self, key: str, new_key: str) -> None:
        """`new_key` holds what `key` held (in place of its own), `key` nothing."""
        ...

    def close(self) -> None:
        """Returns once every change asked for has landed."""
        ...


WRITE_BATCH_BYTES = 4 * 1024 * 1024


def _finish(handle: BinaryIO, rest: bytes | bytearray) -> None:
    """The last bytes, then to disk and closed: the file may become the blob."""
    handle.write(rest)
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()


class LocalBlobStore:
    """Blobs as files under one folder; writes are atomic (temp file, then rename)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not KEY_PATTERN.match(key) or ".." in key:
            raise ValueError(f"invalid blob key {key!r}")
        return self.root / key.replace(":", "_")

    @contextlib.contextmanager
    def _atomic_file(self, key: str) -> Iterator[BinaryIO]:
        """A file that becomes the blob only once fully written and synced."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put(self, key: str, data: bytes) -> None:
        with self._atomic_file(key) as handle:
            handle.write(data)

    async def put_chunks(self, key: str, chunks: AsyncIterator[bytes], limit: int) -> int:
        """Writes and the final fsync run in a thread, a few MiB at a time: a snapshot
        image of hundreds of MB written from the event loop would stall every request
        and channel of the control plane for as long as the disk takes."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        handle = os.fdopen(fd, "wb")
        size = 0
        pending = bytearray()
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise ValueError(f"blob {key} is over the limit of {limit} bytes")
                pending += chunk
                if len(pending) >= WRITE_BATCH_BYTES:
                    data, pending = pending, bytearray()
                    await asyncio.to_thread(handle.write, data)
            await asyncio.to_thread(_finish, handle, pending)
            os.replace(tmp, path)
        except BaseException:
            handle.close()
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def open(self, key: str) -> BinaryIO | None:
        try:
            return self._path(key).open("rb")
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def direct_url(self, key: str) -> str | None:
        return None  # only this server reads its folder

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_outcomes(self) -> list[tuple[str, bool]]:
        return []  # a delete raises before it returns, or has landed

    def listing(self, prefix: str) -> list[tuple[str, float]]:
        folder = self.root / prefix.replace(":", "_")
        found = []
        for path in folder.rglob("*") if folder.is_dir() else []:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                if path.is_file() and not path.name.startswith(".tmp-"):
                    found.append((path.relative_to(self.root).as_posix(), path.stat().st_mtime))
        return sorted(found)

    def rename(self, key: str, new_key: str) -> None:
        target = self._path(new_key)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._path(key), target)

    def close(self) -> None:
        pass  # every change landed when it returned
