"""asyncio HTTP clients kept per event loop, so that `acall` and its kin reuse connections.

An `httpx.AsyncClient` belongs to the event loop it first ran on, so one is kept per
loop (and process, and key). Each is closed with its loop: an async generator started on
the loop holds it, and `asyncio.run` (like uvloop's and any runner that calls
`loop.shutdown_asyncgens()`) closes every live async generator before the loop closes,
which runs the generator's `finally` and closes the client there. Clients of loops that
were closed some other way are dropped the next time one is asked for.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncGenerator, Callable, Hashable
from dataclasses import dataclass

import httpx


@dataclass(eq=False)
class _Kept:
    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    closer: AsyncGenerator[None, None]  # holds the client; closed with the loop


_lock = threading.Lock()
_kept: dict[tuple[int, int, Hashable], _Kept] = {}


async def _closed_with_the_loop(client: httpx.AsyncClient) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await client.aclose()


async def kept_client(key: Hashable, make: Callable[[], httpx.AsyncClient]) -> httpx.AsyncClient:
    """The running loop's client for `key`, made by `make` the first time."""
    loop = asyncio.get_running_loop()
    slot = (os.getpid(), id(loop), key)
    with _lock:
        for stale in [k for k, kept in _kept.items() if kept.loop.is_closed()]:
            del _kept[stale]  # its connections close as the client is collected
        kept = _kept.get(slot)
        if kept is not None and kept.loop is loop and not kept.client.is_closed:
            return kept.client
        client = make()
        kept = _kept[slot] = _Kept(loop, client, _closed_with_the_loop(client))
    # Its first step ties the generator to this loop (the loop's async generator hooks).
    await kept.closer.asend(None)
    return client
