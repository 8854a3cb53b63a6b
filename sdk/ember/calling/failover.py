"""Several servers of one platform, from the client's side: a request that cannot connect
to one is sent to the next (nothing of it was sent; one whose server closed the connection
during the TLS handshake, a process handing over, is tried again a few times like a cut
one, whatever its method), and one whose connection was cut
before the answer is sent again only when running it twice is harmless: a GET, HEAD,
OPTIONS, PUT or DELETE, or a request with an `Idempotency-Key` (a spawn given
`_idempotency_key`). Other cut requests fail with `ConnectionCutError`, which says the
call may or may not have run. The same holds for a 503 `control_plane_stopping`, the
answer of a process that stopped in order while holding the call.

The server that answered last is tried first next time, so a dead one costs one failed
connection, not one per request."""

from __future__ import annotations

import ssl
import threading

import httpx

# Cut connections are tried again this many times, this far apart: a platform's other
# processes hold a new connection until the next owner serves (a few seconds at most).
CUT_RETRIES = 3
CUT_RETRY_S = 0.2
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


def replayable(request: httpx.Request) -> bool:
    """Whether sending `request` twice does no more than sending it once (and its body,
    bytes in memory, can be sent again whole)."""
    safe = request.method in SAFE_METHODS or "idempotency-key" in request.headers
    return safe and isinstance(request.stream, httpx.ByteStream)


def closed_in_handshake(exc: BaseException) -> bool:
    """Whether a connection error is a server closing (or resetting) the connection it
    had accepted before the TLS handshake was done, rather than refusing it."""
    seen: BaseException | None = exc
    for _ in range(8):  # httpx's error, httpcore's, the ssl module's
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLEOFError | ssl.SSLZeroReturnError | ConnectionResetError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


STOPPING = b'"control_plane_stopping"'  # the error type of a process handing its calls over


def handed_over(response: httpx.Response) -> bool:
    """Whether `response` (read already) says its server stopped before the call ran to
    its end while another process of the platform takes over: a 503 to send again."""
    return response.status_code == 503 and STOPPING in response.content


class Servers:
    """The servers a client may send to, and the one it sends to now."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = [httpx.URL(url) for url in urls]
        self._current = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.urls)

    def aimed(self, request: httpx.Request) -> httpx.Request:
        """`request`, sent to the current server (its path and query kept)."""
        if len(self.urls) < 2:
            return request
        with self._lock:
            server = self.urls[self._current]
        url = request.url.copy_with(scheme=server.scheme, host=server.host, port=server.port)
        if url != request.url:
            request.url = url
            request.headers["Host"] = url.netloc.decode("ascii")
        return request

    def failed(self, request: httpx.Request) -> None:
        """The server `request` went to could not be reached: the next one is current."""
        with self._lock:
            for index, server in enumerate(self.urls):
                if (server.host, server.port) == (request.url.host, request.url.port):
                    self._current = (index + 1) % len(self.urls)
                    return
            self._current = (self._current + 1) % len(self.urls)
