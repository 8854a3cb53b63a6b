"""A process that does not own the platform serves its listening socket by piping each
connection, bytes as they come, to the owner's: TLS ends at the owner (every process
holds the same CA and certificate), so calls, streams, SSE, WebSockets and the agents'
and replicas' channels all pass unchanged, in both directions, with the flow control of
the two sockets. A client's kept-alive connection is one connection to the owner.

While no owner is known (between an owner's death and a takeover) a new connection waits
for one, up to `hold_seconds`, rather than fail: a caller sees a slower answer, not an
error. When the owner goes, the connections piped to it are closed, as its own would be."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("ember.server")

CONNECT_TIMEOUT_S = 1.0  # to an owner on another machine that may have died
RETRY_S = 0.05  # after an owner refused: the lease names the next one soon


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def address_of(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"{url} names no host")
    return parts.hostname, parts.port or 443


class _Half(asyncio.Protocol):
    """One side of a pipe: what it reads, its peer writes; a peer that cannot keep up
    pauses this side's reading."""

    def __init__(self) -> None:
        self.transport: Any = None  # an asyncio.Transport (uvloop's are not its subclass)
        self.peer: _Half | None = None
        self.closed = False
        self.eof = False  # this side's reader has ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.transport.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
            if peer.eof:  # both directions have ended: nothing more can pass, close both
                peer.transport.close()
                return False
            return True  # half-closed: the other direction may still carry the answer
        return False

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.peer is not None:
            self.peer.transport.close()


class _Client(_Half):
    """The caller's side. What it sent is kept until the owner answers anything, so that
    a connection the owner dropped unanswered (it died as the connection came: not even
    the TLS handshake answered) is made again to the next owner, sent the same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.unanswered: list[bytes] | None = []

    def data_received(self, data: bytes) -> None:
        if self.unanswered is not None:
            self.unanswered.append(data)
        super().data_received(data)

    def join(self, upstream: _Upstream) -> None:
        self.peer = upstream
        upstream.peer = self
        for data in self.unanswered or ():
            upstream.transport.write(data)


class _Upstream(_Half):
    """The owner's side: `answered` is True at its first byte, False if it went first."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        if not self.answered.done():
            self.answered.set_result(True)
            if isinstance(self.peer, _Client):
                self.peer.unanswered = None
        super().data_received(data)

    def eof_received(self) -> bool:
        if not self.answered.done():
            return False  # closed unanswered: connection_lost tries the next owner
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.answered.done():
            self.answered.set_result(False)  # the client stays, for another owner
            return
        super().connection_lost(exc)


class Standby:
    """Pipes the connections `sock` accepts to `owner()`'s address while started."""

    def __init__(
        self,
        sock: socket.socket,
        owner: Callable[[], str | None],
        owner_known: asyncio.Event,
        *,
        own_url: str,
        hold_seconds: float,
    ) -> None:
        self._sock = sock
        self._owner = owner
        self._owner_known = owner_known
        self.own_url = own_url
        self.hold_seconds = hold_seconds
        self._stopped = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # A duplicate of the socket: closing this server must leave the listening socket
        # open for the owner's HTTPS server, which serves it next if this process leads.
        self._server = await loop.create_server(self._accepted, sock=self._sock.dup())

    def _accepted(self) -> _Client:
        client = _Client()
        task = asyncio.get_running_loop().create_task(self._connect(client))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return client

    async def _connect(self, client: _Client) -> None:
        """Wait for an owner that answers (within the hold), then join the two."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hold_seconds
        while not client.closed:
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "no process owned the platform within %gs: a connection closed",
                    self.hold_seconds,
                )
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._owner_known.wait(), left)
            url = self._owner()
            if url is None:
                continue
            if url == self.own_url:
                # This process took over: its HTTPS server serves the socket once this
                # one has stopped accepting (else the connection would come back here).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), left)
            try:
                _, upstream = await asyncio.wait_for(
                    loop.create_connection(_Upstream, *address_of(url)),
                    min(left, CONNECT_TIMEOUT_S),
                )
            except (OSError, TimeoutError):
                await asyncio.sleep(RETRY_S)  # an owner that just died: the lease says soon
                continue
            if client.closed:
                upstream.transport.close()
                return
            client.join(upstream)
            if await upstream.answered:
                return
            await asyncio.sleep(RETRY_S)  # it went unanswered: the next owner, same bytes
        if client.transport is not None:
            client.transport.close()

    async def stop(self) -> None:
        """Accept no more. The connections piped already go on (to the old owner, they end
        with it); those still waiting go to the owner once known, this process included."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._stopped.set()
