"""uvicorn's HTTPS server, less a needless wait when it stops, and the gateway's limits.

At shutdown uvicorn closes each idle keep-alive connection, and closing a TLS connection
waits for the peer's close_notify: a client whose pool merely holds the connection (an
SDK process, a worker between bundle fetches) never sends it, so every stop waited out
`timeout_graceful_shutdown` in full. Connections uvicorn closed earlier, for idling past
its keep-alive timeout, wait the same way (asyncio gives up after 30 s). Idle or closing
HTTP connections whose answers have all left are dropped instead; requests in flight keep
their graceful end, as do WebSockets.

The limits (GatewayLimits) bound what a hostile client may hold: the size of a request
head, the time to send it, and the connections open at once, from one address and in all.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import functools
import json
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from ember_platform.http.handshake_gate import HandshakeGate

HANDSHAKE_SECONDS = 60.0  # asyncio's own limit on a TLS handshake
# The longest a connection holds its turn at the handshake gate (a handshake of a client
# across the world takes a few round trips, each well under a second).
TURN_SECONDS = 2.0
MAX_EARLY_BYTES = 64 * 1024  # a ClientHello is a few hundred bytes to a few KiB


def tls_protocol(loop: asyncio.AbstractEventLoop) -> Any:
    """The TLS protocol class of the loop's own (uvloop's, or asyncio's), the one its
    servers wrap connections in: the same code on the hot path as before."""
    try:
        import uvloop
        from uvloop.loop import SSLProtocol  # type: ignore[attr-defined]
    except ImportError:
        return asyncio.sslproto.SSLProtocol
    return SSLProtocol if isinstance(loop, uvloop.Loop) else asyncio.sslproto.SSLProtocol


def drop_idle_connections(connections: Iterable[Any]) -> int:
    """Abort the HTTP connections with no request in flight and nothing left to send;
    how many there were."""
    dropped = 0
    for connection in list(connections):
        if not hasattr(connection, "cycle"):  # a WebSocket: its close handshake is kept
            continue
        cycle = connection.cycle
        transport = getattr(connection, "transport", None)
        if transport is None or (cycle is not None and not cycle.response_complete):
            continue
        # One closing already waits for the peer's close_notify too (uvicorn closes a
        # connection idle past its keep-alive timeout the same way): dropped as well.
        if transport.get_write_buffer_size():
            continue
        transport.abort()
        dropped += 1
    return dropped


class PromptShutdownServer(uvicorn.Server):
    async def startup(self, sockets: Any = None) -> None:
        # Its connections come in as TCP: the protocol shakes hands for TLS itself, in
        # turn (handshake_gate.py). The context stays in the config, where it reads it.
        tls, self.config.ssl = self.config.ssl, None
        try:
            await super().startup(sockets)
        finally:
            self.config.ssl = tls

    async def shutdown(self, sockets: Any = None) -> None:
        drop_idle_connections(self.server_state.connections)
        await super().shutdown(sockets)


@dataclass(frozen=True)
class GatewayLimits:
    """What one client may hold of the gateway before it is refused."""

    max_head_bytes: int = 64 * 1024  # request line and headers, in all
    max_headers: int = 100
    head_timeout: float = 10.0  # seconds to finish a request head once it may start
    max_connections: int = 10_000
    max_connections_per_address: int = 1_000


class ConnectionCounts:
    """The open connections, server-wide and per client address. A connection upgraded to
    a WebSocket leaves its HTTP protocol without telling it, so a count that reaches its
    cap is first pruned of closed transports, rather than trusted; what is held stays
    bounded by the server-wide cap."""

    def __init__(self, limits: GatewayLimits) -> None:
        self._limits = limits
        self._all: dict[Any, str | None] = {}  # transport: its client's address
        self._by_address: dict[str, set[Any]] = {}

    def admit(self, transport: Any, address: str | None) -> bool:
        """Count this connection in, or say it is one too many (then it is not counted).
        A connection without an address (a Unix socket's) is capped server-wide only."""
        if len(self._all) >= self._limits.max_connections:
            self._release_closed(list(self._all))
            if len(self._all) >= self._limits.max_connections:
                return False
        if address is not None:
            cap = self._limits.max_connections_per_address
            if self.count(address) >= cap:
                self._release_closed(list(self._by_address[address]))
                if self.count(address) >= cap:
                    return False
            self._by_address.setdefault(address, set()).add(transport)
        self._all[transport] = address
        return True

    def release(self, transport: Any) -> None:
        address = self._all.pop(transport, None)
        mine = self._by_address.get(address) if address is not None else None
        if address is not None and mine is not None:
            mine.discard(transport)
            if not mine:
                del self._by_address[address]

    def count(self, address: str | None = None) -> int:
        if address is None:
            return len(self._all)
        return len(self._by_address.get(address, ()))

    def _release_closed(self, transports: list[Any]) -> None:
        for transport in transports:
            if transport.is_closing():
                self.release(transport)


def _refusal(status: int, kind: str, message: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    reason = HTTPStatus(status).phrase.encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n%s\r\n" % (status, reason, len(body), extra)
    ) + body


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head past the limits."""


class HeadDeadlines:
    """Closes connections that take longer than the head timeout to send a request head.
    One sweep over the open connections every fraction of the timeout, rather than a timer
    armed and cancelled for every request: the common request pays for one clock read."""

    def __init__(self, head_timeout: float) -> None:
        self._timeout = head_timeout
        self._interval = min(1.0, head_timeout / 4)  # a slow head lives at most 25 % longer
        self._watched: set[LimitedHttpProtocol] = set()
        self._sweep_handle: asyncio.TimerHandle | None = None

    def watch(self, protocol: LimitedHttpProtocol) -> None:
        self._watched.add(protocol)
        if self._sweep_handle is None:
            self._sweep_handle = protocol.loop.call_later(
                self._interval, self._sweep, protocol.loop
            )

    def forget(self, protocol: LimitedHttpProtocol) -> None:
        self._watched.discard(protocol)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep_handle = None
        too_old = loop.time() - self._timeout
        for protocol in list(self._watched):
            if protocol.transport.is_closing():
                # A connection upgraded to a WebSocket left its HTTP protocol unawares:
                # connection_lost never comes to forget it.
                self._watched.discard(protocol)
                continue
            began = protocol.head_began
            if began is not None and began < too_old:
                protocol.head_timed_out()
        if self._watched:  # nothing scheduled once the server has no connections left
            self._sweep_handle = loop.call_later(self._interval, self._sweep, loop)


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the gateway's limits: bytes of a request head are
    counted as they arrive, before the parser keeps any, so an endless header is refused
    (431) without being held; a head must be complete within `head_timeout` of its first
    byte or of the connection (idle keep-alive connections close after uvicorn's own
    keep-alive timeout); connections past the caps are answered 503. Once its head is
    complete a request (a stream, a long call, a WebSocket) runs free of these timeouts."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: GatewayLimits,
        counts: ConnectionCounts,
        deadlines: HeadDeadlines,
        gate: HandshakeGate,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._gate = gate
        self._handshake: asyncio.Task[None] | None = None  # TLS, in its turn
        self._early: list[bytes] = []  # what came before its handshake's turn
        self._raw: asyncio.Transport | None = None  # its TCP transport, before TLS
        self._serving = False
        self._limits = limits
        self._counts = counts
        self._deadlines = deadlines
        self._counted = False
        self._reading_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._head_too_large = False
        # When the head being read began (loop time); None between requests and once a
        # head is complete. HeadDeadlines reads it.
        self.head_began: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        tls = self.config.ssl
        if tls is not None and transport.get_extra_info("sslcontext") is None:
            self._raw = transport
            self._handshake = self.loop.create_task(self._secure(transport, tls))
            return
        self._serve(transport)

    def transport_before_tls(self) -> asyncio.Transport:
        assert self._raw is not None
        return self._raw

    async def _secure(self, transport: asyncio.Transport, tls: ssl.SSLContext) -> None:
        """Wait for this connection's turn, then shake hands: the loop's own TLS protocol
        takes the connection over, with what it sent meanwhile, and calls
        `connection_made` again with the TLS transport once the handshake is done."""
        peer = transport.get_extra_info("peername")
        await self._gate.turn(peer[0] if isinstance(peer, tuple) else None)
        holding = True  # its turn
        try:
            handshake = self.loop.create_future()
            secure = tls_protocol(self.loop)(
                self.loop,
                self,
                tls,
                handshake,
                server_side=True,
                ssl_handshake_timeout=HANDSHAKE_SECONDS,
            )
            transport.set_protocol(secure)
            secure.connection_made(transport)
            early, self._early = b"".join(self._early), []
            while early:  # the ClientHello, read before this turn came
                room = secure.get_buffer(len(early))
                taken = min(len(room), len(early))
                room[:taken] = early[:taken]
                secure.buffer_updated(taken)
                early = early[taken:]
            transport.resume_reading()
            # A turn is for the handshake's CPU, not for a client that sends nothing
            # (or its ClientHello byte by byte): past TURN_SECONDS it goes on, within
            # HANDSHAKE_SECONDS, and the next connection in turn starts its own.
            try:
                await asyncio.wait({handshake}, timeout=TURN_SECONDS)
            except asyncio.CancelledError:
                handshake.cancel()
                raise
            if not handshake.done():
                holding = False
                self._gate.done()
            await handshake
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError):
            transport.abort()  # a failed handshake: nothing to answer
        finally:
            if holding:
                self._gate.done()

    def _serve(self, transport: asyncio.Transport) -> None:
        self._serving = True
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if not self._counts.admit(transport, address):
            message = "too many connections; try again shortly"
            transport.write(_refusal(503, "service_unavailable", message, b"retry-after: 1\r\n"))
            transport.close()
            return
        self._counted = True
        self.head_began = self.loop.time()  # the first head is due from the connection on
        self._deadlines.watch(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._serving:  # it left before or during its handshake
            if self._handshake is not None:
                self._handshake.cancel()
            return
        if self._counted:
            self._deadlines.forget(self)
            self._counts.release(self.transport)
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._serving:  # TLS bytes before its handshake's turn: kept for it
            self.transport_before_tls().pause_reading()
            self._early.append(data)
            if sum(map(len, self._early)) > MAX_EARLY_BYTES:
                self.transport_before_tls().abort()
            return
        if not self._reading_head:
            super().data_received(data)
            return
        if self.head_began is None:
            self.head_began = self.loop.time()
        room = self._limits.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # Only what the head may still take is parsed; the rest, if the head ended within
        # it, is a body (or the next request), else it is never kept.
        self._head_bytes += room
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._reading_head:
            limit = self._limits.max_head_bytes
            self._refuse_head(f"the request line and headers exceed {limit} bytes")
            return
        # The rest goes to whoever reads the connection now (a WebSocket, if it upgraded).
        self.transport.get_protocol().data_received(data[room:])

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted as they are parsed: a head of many tiny headers is stopped at the limit,
        # not held whole until its end.
        self._header_count += 1
        if self._header_count > self._limits.max_headers:
            self._head_too_large = True
            raise _HeadTooLarge()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        self._header_count = 0
        self.head_began = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True  # what arrives next is the next request's head

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:  # the parser stopped at a header past the limit
            self._refuse_head(f"a request may have at most {self._limits.max_headers} headers")
            return
        super().send_400_response(msg)

    def head_timed_out(self) -> None:
        self.head_began = None
        if self._reading_head and not self.transport.is_closing():
            # Aborted, not closed: a TLS close would wait for the peer's close_notify.
            self.transport.abort()

    def _refuse_head(self, message: str) -> None:
        self.head_began = None
        self.transport.write(_refusal(431, "request_header_fields_too_large", message))
        self.transport.close()


def limited_protocol(limits: GatewayLimits) -> Any:
    """The protocol factory for uvicorn.Config(http=...): each connection a
    LimitedHttpProtocol, all counted and swept for slow heads together."""
    return functools.partial(
        LimitedHttpProtocol,
        limits=limits,
        counts=ConnectionCounts(limits),
        deadlines=HeadDeadlines(limits.head_timeout),
        gate=HandshakeGate(),
    )
