"""The platform's HTTPS clients, as every call and command reaches the control plane.

- Transports that say which server could not be reached and what to check, fail over
  along several servers (`failover.py`), and tell a connection cut before its answer
  (`ConnectionCutError`: sent again only when the request may run twice) from one cut
  while its body was read.
- One client per process, platform and credentials, kept (`shared_client`): a call reuses
  a connection instead of loading the CA and shaking hands again, about 3 ms a call on
  loopback. Closed when the process exits, or before a replica's snapshot.
- asyncio clients kept per event loop (`shared_async_client`): an `httpx.AsyncClient`
  belongs to the loop it first ran on, so one is kept per loop (and process, and key).
  Each is closed with its loop: an async generator started on the loop holds it, and
  `asyncio.run` (like uvloop's and any runner that calls `loop.shutdown_asyncgens()`)
  closes every live async generator before the loop closes, which runs the generator's
  `finally` and closes the client there. Clients of loops that were closed some other
  way are dropped the next time one is asked for.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from ember.calling.failover import (
    CUT_RETRIES,
    CUT_RETRY_S,
    Servers,
    closed_in_handshake,
    handed_over,
    replayable,
)
from ember.calling.tlsclient import client_context
from ember.config import ClientConfig
from ember.errors import ConnectionCutError, ServerUnreachableError


def _unreachable(request: httpx.Request, exc: Exception) -> ServerUnreachableError:
    server = f"{request.url.scheme}://{request.url.netloc.decode()}"
    return ServerUnreachableError(
        f"cannot reach the Ember server at {server} ({exc}): is `ember server` "
        "running there? The client config (`ember server` writes it) or "
        "EMBER_SERVER_URL says where it is"
    )


def _cut_off(request: httpx.Request) -> ConnectionCutError:
    server = f"{request.url.scheme}://{request.url.netloc.decode()}"
    return ConnectionCutError(
        f"the Ember server at {server} closed the connection before it answered "
        "(it may be restarting, or one of its processes failed over): the call may or "
        "may not have run; retry it if running it twice is harmless"
    )


class _BodyCut(ConnectionCutError, httpx.RemoteProtocolError):
    """A connection cut while the answer's body was read: ConnectionCutError to a call,
    and still the RemoteProtocolError a stream's reader turns into its own message."""


def _body_cut(request: httpx.Request) -> _BodyCut:
    error = _BodyCut(str(_cut_off(request)))
    error._request = request  # as httpx's own errors carry it
    return error


class _CutSyncStream(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, request: httpx.Request) -> None:
        self._stream, self._request = stream, request

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except (httpx.RemoteProtocolError, httpx.ReadError):
            raise _body_cut(self._request) from None

    def close(self) -> None:
        self._stream.close()


class _CutAsyncStream(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, request: httpx.Request) -> None:
        self._stream, self._request = stream, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except (httpx.RemoteProtocolError, httpx.ReadError):
            raise _body_cut(self._request) from None

    async def aclose(self) -> None:
        await self._stream.aclose()


class _Attempts:
    """One request's tries along the platform's servers, and what each failure allows
    next: the sync and async transports differ only in how they wait and read."""

    def __init__(self, servers: Servers, request: httpx.Request) -> None:
        self.servers, self.request = servers, request
        self.unreachable = self.cuts = 0

    def aimed(self) -> httpx.Request:
        self.request = self.servers.aimed(self.request)
        return self.request

    def refused(self, exc: Exception) -> float:
        """Not reached: the next server is tried, or the error raised once each was. A
        server that took the connection and closed it during the TLS handshake (a
        process of the platform handing over, or losing its lease) is tried again like a
        cut connection, whatever the request: none of it was sent. Returns how long to
        wait before the next try."""
        if closed_in_handshake(exc) and self.cuts < CUT_RETRIES:
            self.cuts += 1
            if len(self.servers) > 1:
                self.servers.failed(self.request)
            return CUT_RETRY_S
        self.unreachable += 1
        if self.unreachable >= max(len(self.servers), 1):
            raise _unreachable(self.request, exc) from None
        self.servers.failed(self.request)
        return 0.0

    def cut(self) -> None:
        """Cut before its answer: tried again (after `CUT_RETRY_S`) only when it may run
        twice, a few times; else the error that says it may or may not have run."""
        self.cuts += 1
        if self.cuts > CUT_RETRIES or not replayable(self.request):
            raise _cut_off(self.request) from None

    def may_be_handed_over(self, response: httpx.Response) -> bool:
        """A 503 that may be a stopping owner's (its body tells): worth reading."""
        return response.status_code == 503 and self.cuts < CUT_RETRIES and replayable(self.request)

    def handed_over(self, response: httpx.Response) -> bool:
        """The owner was stopping: the request goes again (after `CUT_RETRY_S`)."""
        if not handed_over(response):
            return False
        self.cuts += 1
        return True


class _ReachingTransport(httpx.HTTPTransport):
    """Says which server could not be reached, and what to check, instead of a bare
    connection error from deep inside the HTTP stack; with several servers, fails over
    (`ember.calling.failover`)."""

    def __init__(self, servers: tuple[str, ...] = (), **options: Any) -> None:
        super().__init__(**options)
        self.servers = Servers(servers)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        tries = _Attempts(self.servers, request)
        while True:
            try:
                response = super().handle_request(tries.aimed())
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                time.sleep(tries.refused(exc))
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError):
                tries.cut()
                time.sleep(CUT_RETRY_S)
                continue
            assert isinstance(response.stream, httpx.SyncByteStream)
            response.stream = _CutSyncStream(response.stream, tries.request)
            if not tries.may_be_handed_over(response):
                return response
            response.read()
            if not tries.handed_over(response):
                return response
            response.close()
            time.sleep(CUT_RETRY_S)


class _ReachingAsyncTransport(httpx.AsyncHTTPTransport):
    """The same, for the async client."""

    def __init__(self, servers: tuple[str, ...] = (), **options: Any) -> None:
        super().__init__(**options)
        self.servers = Servers(servers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        tries = _Attempts(self.servers, request)
        while True:
            try:
                response = await super().handle_async_request(tries.aimed())
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                await asyncio.sleep(tries.refused(exc))
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError):
                tries.cut()
                await asyncio.sleep(CUT_RETRY_S)
                continue
            assert isinstance(response.stream, httpx.AsyncByteStream)
            response.stream = _CutAsyncStream(response.stream, tries.request)
            if not tries.may_be_handed_over(response):
                return response
            await response.aread()
            if not tries.handed_over(response):
                return response
            await response.aclose()
            await asyncio.sleep(CUT_RETRY_S)


# A kept connection idle this long is closed by the client: under the server's own
# keep-alive (5 s, `ember server --keep-alive`), so that no request goes out on a
# connection the server is closing at that moment (a cut, and a POST not sent again).
# At httpx's 5 s, the same as the server's, a call after a 5 s pause was cut now and then.
KEPT_IDLE_SECONDS = 4.0
DEFAULT_CONNECTIONS = 100  # httpx's defaults
DEFAULT_KEPT_CONNECTIONS = 20


def _headers(config: ClientConfig) -> dict[str, str]:
    """The token, and the workspace an admin token acts in when the config names one."""
    headers = {"Authorization": f"Bearer {config.token}"}
    if config.workspace:
        headers["Ember-Workspace"] = config.workspace
    return headers


def platform_client(
    config: ClientConfig, timeout: float | None, connections: int | None = None
) -> httpx.Client:
    """An HTTPS client for the platform: its CA, the config's token, and a clear error
    when the server cannot be reached (`ServerUnreachableError`). `connections` sizes its
    pool for that many concurrent requests (httpx's defaults otherwise)."""
    limits = httpx.Limits(
        max_connections=connections or DEFAULT_CONNECTIONS,
        max_keepalive_connections=connections or DEFAULT_KEPT_CONNECTIONS,
        keepalive_expiry=KEPT_IDLE_SECONDS,
    )
    return httpx.Client(
        base_url=config.server_url,
        transport=_ReachingTransport(
            config.server_urls, verify=client_context(config.ca_cert), limits=limits
        ),
        headers=_headers(config),
        timeout=request_timeout(timeout),
    )


_shared_lock = threading.Lock()
_shared: dict[tuple[Any, ...], httpx.Client] = {}
_closed_at_exit = False  # whether close_shared_clients is registered with atexit


def shared_client(config: ClientConfig) -> httpx.Client:
    """This process's client for `config` (give each request its own timeout)."""
    # With the list: a client of several servers fails over, one of its first alone not.
    key: tuple[Any, ...] = (os.getpid(), config.server_url, config.token, config.ca_cert)
    key = (*key, config.workspace, *config.server_urls)
    global _closed_at_exit
    with _shared_lock:
        client = _shared.get(key)
        if client is None or client.is_closed:
            client = _shared[key] = platform_client(config, None)
        if not _closed_at_exit:
            # Its connections end politely at exit, not as sockets the collector finds open.
            atexit.register(close_shared_clients)
            _closed_at_exit = True
        return client


def close_shared_clients() -> None:
    """Close this process's kept connections (a replica does before its snapshot, which
    must hold no open connection). Clients a forked child inherited are dropped, never
    closed: their connections are its parent's."""
    with _shared_lock:
        clients = [c for key, c in _shared.items() if key[0] == os.getpid()]
        _shared.clear()
    for client in clients:
        client.close()


def request_timeout(seconds: float | None) -> httpx.Timeout:
    """`seconds` for a whole request (None: no limit), ten to connect."""
    return httpx.Timeout(seconds, connect=10.0)


# asyncio code may have any number of calls in flight at once (`asyncio.gather`): none
# waits for a connection, and this many idle ones are kept for the next calls.
ASYNC_KEPT_CONNECTIONS = 64


def async_platform_client(config: ClientConfig, timeout: float | None) -> httpx.AsyncClient:
    """`platform_client` for asyncio code."""
    limits = httpx.Limits(
        max_connections=None,
        max_keepalive_connections=ASYNC_KEPT_CONNECTIONS,
        keepalive_expiry=KEPT_IDLE_SECONDS,
    )
    return httpx.AsyncClient(
        base_url=config.server_url,
        transport=_ReachingAsyncTransport(
            config.server_urls, verify=client_context(config.ca_cert), limits=limits
        ),
        headers=_headers(config),
        timeout=request_timeout(timeout),
    )


async def shared_async_client(config: ClientConfig) -> httpx.AsyncClient:
    """The running event loop's client for `config`, kept for the loop's life (give each
    request its own timeout): `shared_client` for asyncio code."""
    key = (config.server_url, config.token, config.ca_cert, config.workspace, *config.server_urls)
    return await kept_client(key, lambda: async_platform_client(config, None))


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
