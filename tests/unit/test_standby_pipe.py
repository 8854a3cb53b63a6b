"""A standby's pipe to the owner, with real sockets on loopback: bytes pass both ways as
they come; a new connection waits for an owner while there is none; one the owner dropped
before answering anything goes, with the same bytes, to the next owner."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from ember_platform.peers.standby import Standby


class Owner:
    """A TCP server standing in for the owner's HTTPS port: it answers each read with
    `prefix + data`, or, while `drop` is above zero, closes the connection unanswered."""

    def __init__(self, prefix: bytes, drop: int = 0) -> None:
        self.prefix = prefix
        self.drop = drop
        self.received: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"https://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        data = await reader.read(65536)
        self.received.append(data)
        if self.drop > 0:
            self.drop -= 1
            writer.close()
            return
        while data:
            writer.write(self.prefix + data)
            await writer.drain()
            data = await reader.read(65536)
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0.05)  # the closes land before the loop ends


def listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    return sock


async def exchange(port: int, messages: list[bytes]) -> list[bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = []
    for message in messages:
        writer.write(message)
        await writer.drain()
        answers.append(await asyncio.wait_for(reader.read(65536), 5))
    writer.close()
    await writer.wait_closed()
    return answers


def run_to_the_end(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """`asyncio.run(main())`, letting every transport's close land before the loop ends
    and collecting what is left, so a socket left open fails this test, not a later one
    (pytest turns the unclosed socket's warning into an error wherever it is collected)."""

    async def then_settle() -> None:
        await main()
        await asyncio.sleep(0.2)

    asyncio.run(then_settle())
    gc.collect()


def test_bytes_pass_both_ways_and_a_connection_waits_for_an_owner() -> None:
    async def run() -> None:
        owner = Owner(b"owner:")
        url = await owner.start()
        current: list[str | None] = [None]
        known = asyncio.Event()
        sock = listening()
        standby = Standby(sock, lambda: current[0], known, own_url="https://me:1", hold_seconds=5)
        await standby.start()
        port = sock.getsockname()[1]
        talk = asyncio.ensure_future(exchange(port, [b"hello", b"again"]))
        await asyncio.sleep(0.2)
        assert not talk.done()  # no owner yet: it waits rather than fail
        current[0] = url
        known.set()
        assert await talk == [b"owner:hello", b"owner:again"]
        await standby.stop()
        await owner.close()
        sock.close()

    run_to_the_end(run)


def test_a_connection_the_owner_dropped_unanswered_goes_to_the_next_owner() -> None:
    async def run() -> None:
        dying, next_owner = Owner(b"old:", drop=1000), Owner(b"new:")
        urls = [await dying.start(), await next_owner.start()]
        current: list[str | None] = [urls[0]]
        known = asyncio.Event()
        known.set()
        sock = listening()
        standby = Standby(sock, lambda: current[0], known, own_url="https://me:1", hold_seconds=5)
        await standby.start()

        def next_one() -> None:
            current[0] = urls[1]  # the lease names the next owner soon after

        asyncio.get_running_loop().call_later(0.2, next_one)
        answers = await exchange(sock.getsockname()[1], [b"hello"])
        assert answers == [b"new:hello"]
        assert dying.received and set(dying.received) == {b"hello"}  # got it, dropped it
        assert next_owner.received[0] == b"hello"  # sent again, the same bytes
        await standby.stop()
        await dying.close()
        await next_owner.close()
        sock.close()

    run_to_the_end(run)
