"""`@ember.asgi_app()`: an endpoint that is a whole web app (FastAPI, Starlette, any ASGI
app), served under its URL with every method and path, and how its requests and
responses travel between the gateway and the replica.

A request goes to the replica as one JSON input: method, path, root path, query string,
headers and the body in base64. The answer comes back as stream events: first the
status and headers, then body chunks in base64, as the app sends them.

A WebSocket session is one input too (kind "websocket", no body). The caller's messages
follow it as `message` frames, and the app's ASGI messages (accept, send, close) come
back as stream events; bytes travel in base64 both ways.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.errors import InvalidError

F = TypeVar("F", bound=Callable[..., Any])

ASGI_ATTR = "__ember_asgi__"
# Body bytes per response event: base64 makes them a third larger on the channel.
RESPONSE_CHUNK_BYTES = 1024 * 1024
# Hop-by-hop headers belong to one connection; the gateway's own connection has its own.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
    }
)


def asgi_app() -> Callable[[F], F]:
    """Mark a function that returns an ASGI app (e.g. a FastAPI instance) as the endpoint's
    web app. Put it under `@ember.endpoint(...)`:

        @ember.endpoint(public=True, concurrency=32)
        @ember.asgi_app()
        def web():
            from fastapi import FastAPI
            app = FastAPI()
            ...
            return app

    The function runs once per replica before a snapshot would be taken, so imports and
    models built there are in the image. The app's lifespan startup runs after that (after
    a restore too), before the replica takes requests; its shutdown as the replica stops.
    Requests to `https://host/APP--ENDPOINT/any/path` reach the app with its root path set
    to `/APP--ENDPOINT`.
    """
    return _web_app_marker("asgi_app", wsgi=False)


def wsgi_app() -> Callable[[F], F]:
    """Mark a function that returns a WSGI app (Flask, Django, Bottle) as the endpoint's
    web app, as `@ember.asgi_app()` does for ASGI apps:

        @ember.endpoint(public=True, concurrency=8)
        @ember.wsgi_app()
        def web():
            from flask import Flask
            app = Flask(__name__)
            ...
            return app

    Each request runs in a thread, up to `concurrency` at once, and its response streams
    back as the app yields it. A caller who leaves makes the app's next write raise
    ConnectionAbortedError; `ember.cancelled()` tells the code so sooner. WebSocket
    handshakes are refused (close code 1003): WSGI has no WebSockets.
    """
    return _web_app_marker("wsgi_app", wsgi=True)


def _web_app_marker(name: str, *, wsgi: bool) -> Callable[[F], F]:
    def mark(func: F) -> F:
        if type(func).__name__ == "EndpointDefinition":
            raise InvalidError(
                f"@ember.{name}() goes under @ember.endpoint(...), right above the function"
            )
        if not callable(func) or isinstance(func, type):
            raise InvalidError(f"@ember.{name}() decorates a function, not {func!r}")
        if getattr(func, ASGI_ATTR, False):
            raise InvalidError(f"{func!r} is marked as a web app twice")
        setattr(func, ASGI_ATTR, "wsgi" if wsgi else "asgi")
        return func

    return mark


def is_asgi_factory(target: Any) -> bool:
    """Whether `target` makes the endpoint's web app (ASGI, or WSGI served as ASGI)."""
    return bool(getattr(target, ASGI_ATTR, False))


def is_wsgi_factory(target: Any) -> bool:
    return getattr(target, ASGI_ATTR, None) == "wsgi"


@dataclass(frozen=True)
class HttpRequest:
    """One request as the replica's app sees it (`scope` + its one body message)."""

    method: str
    path: str
    root_path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    kind: str = "http"  # or "websocket"
    # The path as the caller sent it, escapes kept (`a%2Fb` is not `a/b`); None: `path`'s.
    raw_path: bytes | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "kind": self.kind,
                "method": self.method,
                "path": self.path,
                "root_path": self.root_path,
                "query_string": self.query_string.decode("latin-1"),
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.headers],
                "body": base64.b64encode(self.body).decode(),
                "client": list(self.client) if self.client else None,
                "raw_path": None if self.raw_path is None else self.raw_path.decode("latin-1"),
            }
        ).encode()

    @classmethod
    def decode(cls, text: str) -> HttpRequest:
        data = json.loads(text)
        client = data.get("client")
        return cls(
            method=data["method"],
            path=data["path"],
            root_path=data["root_path"],
            query_string=data["query_string"].encode("latin-1"),
            headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in data["headers"]],
            body=base64.b64decode(data["body"]),
            client=(str(client[0]), int(client[1])) if client else None,
            kind=data.get("kind", "http"),
            raw_path=raw.encode("latin-1")
            if isinstance(raw := data.get("raw_path"), str)
            else None,
        )

    def scope(self) -> dict[str, Any]:
        scope: dict[str, Any] = {
            "type": self.kind,
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "scheme": "https",
            "path": self.path,
            "raw_path": self.path.encode() if self.raw_path is None else self.raw_path,
            "root_path": self.root_path,
            "query_string": self.query_string,
            "headers": self.headers,
            "client": self.client,
            "server": None,
            "state": {},
        }
        if self.kind == "websocket":
            protocols = next((v for k, v in self.headers if k == b"sec-websocket-protocol"), b"")
            scope["scheme"] = "wss"
            scope["subprotocols"] = [p.strip() for p in protocols.decode().split(",") if p.strip()]
        else:
            scope["method"] = self.method
        return scope


def _kept_headers(headers: list[tuple[bytes, bytes]]) -> list[list[str]]:
    return [
        [k.decode("latin-1"), v.decode("latin-1")]
        for k, v in headers
        if k.lower() not in HOP_BY_HOP
    ]


def response_start_event(status: int, headers: list[tuple[bytes, bytes]]) -> str:
    return json.dumps({"status": status, "headers": _kept_headers(headers)})


def response_body_events(body: bytes) -> Iterator[str]:
    for start in range(0, len(body), RESPONSE_CHUNK_BYTES):
        chunk = body[start : start + RESPONSE_CHUNK_BYTES]
        yield json.dumps({"body": base64.b64encode(chunk).decode()})


def encode_websocket_message(message: dict[str, Any]) -> str:
    """An ASGI websocket message as JSON: `bytes` in base64 (as `bytes_b64`)."""
    data = {k: v for k, v in message.items() if k != "bytes"}
    if message.get("bytes") is not None:
        data["bytes_b64"] = base64.b64encode(message["bytes"]).decode()
    if "headers" in data:
        data["headers"] = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in data["headers"]]
    return json.dumps(data)


def decode_websocket_message(data: bytes | str) -> dict[str, Any]:
    message = json.loads(data)
    if "bytes_b64" in message:
        message["bytes"] = base64.b64decode(message.pop("bytes_b64"))
    if "headers" in message:
        pairs = message["headers"]
        message["headers"] = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs]
    return message


def whole_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> str:
    """A response whose body came in one message, as one result: start and body."""
    encoded = base64.b64encode(body).decode()
    return json.dumps({"status": status, "headers": _kept_headers(headers), "body": encoded})


def decode_whole_response(data: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    event = json.loads(data)  # once: this is every web request's answer
    return *_response_start(event), base64.b64decode(event["body"])


def decode_response_start(data: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    return _response_start(json.loads(data))


def _response_start(event: dict[str, Any]) -> tuple[int, list[tuple[bytes, bytes]]]:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in event["headers"]]
    return int(event["status"]), headers


def decode_response_body(data: bytes) -> bytes:
    return base64.b64decode(json.loads(data)["body"])
