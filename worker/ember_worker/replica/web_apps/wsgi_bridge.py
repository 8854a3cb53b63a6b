"""A WSGI app (Flask, Django, Bottle: PEP 3333) served as the ASGI app of a web-app
endpoint, so that it travels like any other (`@ember.wsgi_app()`).

Each request runs in a thread of the replica's input pool, as sync inputs do, with
`ember.cancelled()` reading the request's flag there. The response goes back as it is
produced, one chunk behind: a response of one chunk (most are) leaves as one message,
which the replica answers in one frame. When the caller leaves, the thread's next write
raises `ConnectionAbortedError`, as a WSGI server's write to a closed socket would, and
the request ends once its thread does: the slot is not free while the thread runs.
"""

from __future__ import annotations

import asyncio
import io
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any

from ember.cancellation import cancelled, carried

Send = Callable[[dict[str, Any]], Any]
WsgiApp = Callable[..., Iterable[bytes]]


def wsgi_environ(scope: dict[str, Any], body: bytes) -> dict[str, Any]:
    """PEP 3333's environ for an ASGI HTTP scope. Paths are str of latin-1 code points,
    as the PEP asks (UTF-8 bytes of the decoded path, one code point a byte)."""
    root = scope.get("root_path", "")
    path = scope["path"]
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    else:
        root = ""
    client = scope.get("client")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": root.encode().decode("latin-1"),
        "PATH_INFO": path.encode().decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "443",
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "REMOTE_ADDR": client[0] if client else "",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "https"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.input_terminated": True,
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    if body:
        environ["CONTENT_LENGTH"] = str(len(body))
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1").upper().replace("-", "_")
        value = raw_value.decode("latin-1")
        if name == "CONTENT_LENGTH":
            continue  # the body's own length, set above
        if name == "HOST":
            environ["SERVER_NAME"], environ["SERVER_PORT"] = host_and_port(value)
        key = name if name == "CONTENT_TYPE" else f"HTTP_{name}"
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def host_and_port(host: str) -> tuple[str, str]:
    """A Host header's name and port ("[::1]:8443" too); 443 when it names none."""
    name, colon, port = host.rpartition(":") if not host.endswith("]") else ("", "", "")
    if not colon or not port.isdigit():
        return host, "443"
    return name, port


def status_code(status: str) -> int:
    """The number of a WSGI status line ("404 Not Found")."""
    code = status.split(" ", 1)[0]
    if len(code) != 3 or not code.isdigit():
        raise ValueError(f"the WSGI app's status {status!r} does not start with a 3-digit code")
    return int(code)


class _Response:
    """One request's response, written from the WSGI app's thread."""

    def __init__(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        self.send = send
        self.loop = loop
        self.gone = threading.Event()  # the caller left: the next write fails
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.started = False  # the start went out
        self.held: bytes | None = None  # the last chunk, sent once the next one comes

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], None]:
        if exc_info is not None and self.started:
            raise exc_info[1].with_traceback(exc_info[2])  # too late for another status
        if self.status is not None and exc_info is None:
            raise RuntimeError("start_response was called twice without exc_info")
        status_code(status)
        self.status, self.headers = status, list(headers)
        return self.write

    def write(self, chunk: bytes) -> None:
        if self.status is None:
            raise RuntimeError("the WSGI app wrote its body before calling start_response")
        if not chunk:
            return
        if self.held is not None:
            self._out(self.held, more=True)
        self.held = bytes(chunk)

    def finish(self) -> None:
        if self.status is None:
            raise RuntimeError("the WSGI app returned without calling start_response")
        self._out(self.held or b"", more=False)

    def _out(self, body: bytes, *, more: bool) -> None:
        # The input's flag (this thread's) is set the moment the caller leaves; `gone` once
        # the bridge's task hears of it.
        if self.gone.is_set() or cancelled():
            raise ConnectionAbortedError("the caller left")
        if not self.started:
            headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers]
            start = {"type": "http.response.start", "status": status_code(self.status or "")}
            self._send({**start, "headers": headers})
            self.started = True
        self._send({"type": "http.response.body", "body": body, "more_body": more})

    def _send(self, message: dict[str, Any]) -> None:
        asyncio.run_coroutine_threadsafe(self.send(message), self.loop).result()


class WsgiBridge:
    """The ASGI app that serves `app` with threads of `executor`."""

    def __init__(self, app: WsgiApp, executor: Executor) -> None:
        self.app = app
        self.executor = executor

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # WSGI has none: refused at the handshake
                await send({"type": "websocket.close", "code": 1003})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        loop = asyncio.get_running_loop()
        response = _Response(send, loop)
        environ = wsgi_environ(scope, body)

        def respond() -> None:
            result = self.app(environ, response.start_response)
            try:
                for chunk in result:
                    response.write(chunk)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            response.finish()

        work = loop.run_in_executor(self.executor, carried(respond))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            response.gone.set()
            # A thread cannot be stopped: its slot is free once it has run out.
            await asyncio.wait([work])
            if not work.cancelled():
                work.exception()  # most likely the ConnectionAbortedError it was meant to get
            raise
