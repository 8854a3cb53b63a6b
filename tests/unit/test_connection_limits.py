"""The gateway's limits at the protocol level (ember_platform.http.https_server): the
connection counts, and LimitedHttpProtocol under a real uvicorn server on plain TCP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from ember_platform.http.https_server import (
    ConnectionCounts,
    GatewayLimits,
    HeadDeadlines,
    limited_protocol,
)


class FakeTransport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


def test_counts_cap_each_address_and_the_server() -> None:
    counts = ConnectionCounts(GatewayLimits(max_connections=3, max_connections_per_address=2))
    a1, a2, a3, b1, b2 = (FakeTransport() for _ in range(5))
    assert counts.admit(a1, "10.0.0.1") and counts.admit(a2, "10.0.0.1")
    assert not counts.admit(a3, "10.0.0.1")
    assert counts.admit(b1, "10.0.0.2")
    assert not counts.admit(b2, "10.0.0.2")  # the server is full
    assert counts.count() == 3 and counts.count("10.0.0.1") == 2
    counts.release(a1)
    assert counts.admit(a3, "10.0.0.1")
    assert counts.count("10.0.0.9") == 0


def test_counts_forget_connections_closed_behind_their_back() -> None:
    # A connection upgraded to a WebSocket is never released by the HTTP protocol.
    counts = ConnectionCounts(GatewayLimits(max_connections=10, max_connections_per_address=1))
    upgraded, later = FakeTransport(), FakeTransport()
    assert counts.admit(upgraded, "10.0.0.1")
    assert not counts.admit(later, "10.0.0.1")
    upgraded.closing = True
    assert counts.admit(later, "10.0.0.1")
    assert counts.count("10.0.0.1") == 1
    assert counts.count() == 1  # forgotten server-wide too


def test_connections_without_an_address_are_capped_server_wide_only() -> None:
    counts = ConnectionCounts(GatewayLimits(max_connections=2, max_connections_per_address=1))
    first, second, third = FakeTransport(), FakeTransport(), FakeTransport()
    assert counts.admit(first, None) and counts.admit(second, None)
    assert not counts.admit(third, None)
    counts.release(first)
    assert counts.count() == 1


async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = [(b"content-type", b"text/plain")]
    if scope["path"] == "/stream":  # a response that lasts longer than the head timeout
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(4):
            await asyncio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    answer = b"got %d" % len(body)
    headers.append((b"content-length", b"%d" % len(answer)))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


LIMITS = GatewayLimits(
    max_head_bytes=2048,
    max_headers=10,
    head_timeout=0.3,
    max_connections=50,
    max_connections_per_address=3,
)


@asynccontextmanager
async def serving() -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, lifespan="off", log_level="critical", http=limited_protocol(LIMITS)
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, data: bytes, timeout: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        await closed(writer)


async def closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def run(test: Callable[[int], Awaitable[None]]) -> None:
    async def main() -> None:
        async with serving() as port:
            await test(port)

    asyncio.run(main())


def test_a_stream_outlives_the_head_timeout() -> None:
    async def check(port: int) -> None:
        answer = await exchange(
            port, b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.count(b"tick") == 4

    run(check)


def test_a_body_is_not_counted_as_head() -> None:
    async def check(port: int) -> None:
        body = b"x" * 100_000
        request = (
            b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
            % len(body)
        )
        answer = await exchange(port, request + body)
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b"got 100000")

    run(check)


def test_a_head_past_the_limits_gets_431() -> None:
    async def check(port: int) -> None:
        for extra in (b"X-Big: " + b"a" * 5000 + b"\r\n", b"X-A: b\r\n" * 10):
            answer = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
            assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large")
            body = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert body["error"]["type"] == "request_header_fields_too_large"
        nine = b"X-A: b\r\n" * 8 + b"Connection: close\r\n"
        answer = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + nine + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 200")

    run(check)


def test_a_half_sent_head_is_closed() -> None:
    async def check(port: int) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert answer == b""
        assert 0.2 < loop.time() - started < 3

    run(check)


def test_keep_alive_requests_each_get_their_own_head_budget() -> None:
    async def check(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        filler = b"X-F: " + b"f" * 1500 + b"\r\n"  # most of the 2048 bytes, twice over
        for _ in range(3):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\n")
            line = await asyncio.wait_for(reader.readuntil(b"got 0"), 5)
            assert line.startswith(b"HTTP/1.1 200")
        await closed(writer)

    run(check)


def test_connections_past_the_per_address_cap_get_503() -> None:
    async def check(port: int) -> None:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        answer = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        assert b"retry-after: 1" in head
        assert json.loads(body)["error"]["type"] == "service_unavailable"
        for _, writer in held:
            await closed(writer)
        await asyncio.sleep(0.1)
        answer = await exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200")

    run(check)


class SweptProtocol:
    """What HeadDeadlines reads of a LimitedHttpProtocol."""

    def __init__(self, loop: asyncio.AbstractEventLoop, began: float | None) -> None:
        self.loop = loop
        self.transport = FakeTransport()
        self.head_began = began
        self.timed_out = False

    def head_timed_out(self) -> None:
        self.timed_out = True


def test_the_sweep_closes_slow_heads_only_and_forgets_upgraded_connections() -> None:
    async def check() -> None:
        loop = asyncio.get_running_loop()
        deadlines = HeadDeadlines(head_timeout=0.2)
        slow = SweptProtocol(loop, loop.time())
        between_requests = SweptProtocol(loop, None)
        upgraded = SweptProtocol(loop, None)
        upgraded.transport.closing = True
        for protocol in (slow, between_requests, upgraded):
            deadlines.watch(protocol)  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        assert not slow.timed_out
        await asyncio.sleep(0.25)
        assert slow.timed_out and not between_requests.timed_out
        assert upgraded not in deadlines._watched
        for protocol in (slow, between_requests):
            deadlines.forget(protocol)
        await asyncio.sleep(0.1)
        assert deadlines._sweep_handle is None  # no connections: no more sweeps

    asyncio.run(check())
