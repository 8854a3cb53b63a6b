"""The local blob store's streamed writes: whole, bounded, and off the event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ember_platform.storage import blobs
from ember_platform.storage.blobs import LocalBlobStore


async def stream(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_a_streamed_blob_arrives_whole_across_write_batches(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    parts = [os.urandom(1 << 20) for _ in range(9)] + [b"tail"]  # over two 4 MiB batches
    size = asyncio.run(store.put_chunks("snapshots/k", stream(parts), limit=64 << 20))
    assert size == sum(map(len, parts))
    assert store.get("snapshots/k") == b"".join(parts)
    assert [p.name for p in (tmp_path / "snapshots").iterdir()] == ["k"]  # no temp file left


def test_a_blob_over_its_limit_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    with pytest.raises(ValueError, match="over the limit"):
        asyncio.run(store.put_chunks("snapshots/k", stream([b"x" * 600, b"y" * 600]), 1000))
    assert not store.exists("snapshots/k")
    assert list((tmp_path / "snapshots").iterdir()) == []


def test_the_event_loop_runs_while_the_blob_goes_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync
    loop_ran = threading.Event()
    seen_during_fsync: list[bool] = []

    def slow_fsync(fd: int) -> None:  # a disk that syncs only once the loop has run
        seen_during_fsync.append(loop_ran.wait(5))
        real_fsync(fd)

    monkeypatch.setattr(blobs.os, "fsync", slow_fsync)
    store = LocalBlobStore(tmp_path)

    async def main() -> None:
        async def other_request() -> None:
            while True:
                await asyncio.sleep(0)
                loop_ran.set()

        running = asyncio.ensure_future(other_request())
        await store.put_chunks("snapshots/k", stream([b"z" * 1000]), limit=1 << 20)
        running.cancel()

    asyncio.run(main())
    assert seen_during_fsync == [True]  # other requests were served meanwhile
