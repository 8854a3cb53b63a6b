"""Cross-origin calls from browsers (CORS) to function and class endpoints that allow
them (`@ember.endpoint(cors_origins=[...])`): preflight answers, and the headers that let
a page read the answer; the same for such endpoints' spawned calls (`/v1/calls/{id}`, so
that a page that spawned one can read and cancel it). Web-app endpoints answer CORS
themselves (their own middleware), and their preflights reach them without a token:
browsers send preflights without one."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from ember_platform.edge.asgi_types import Send

ALLOWED_METHODS = b"GET, POST"
# What a caller may send without being asked for (a preflight that names none).
DEFAULT_REQUEST_HEADERS = b"authorization, content-type, prefer, idempotency-key"
# Response headers a page's script may read besides the safelisted ones.
EXPOSED_HEADERS = (
    b"x-ember-call-id, x-ember-trace-id, retry-after, content-disposition, www-authenticate"
)
PREFLIGHT_MAX_AGE = b"600"


def allowed_origin(origins: list[str], headers: dict[bytes, bytes]) -> bytes | None:
    """The request's Origin when the endpoint allows it, else None."""
    origin = headers.get(b"origin")
    if origin is None or not origins:
        return None
    text = origin.decode("latin-1").lower()
    if "*" in origins or text in (allowed.lower() for allowed in origins):
        return origin
    return None


def is_preflight(method: str, headers: dict[bytes, bytes]) -> bool:
    return method == "OPTIONS" and b"access-control-request-method" in headers


def preflight_headers(
    origin: bytes, headers: dict[bytes, bytes], methods: bytes = ALLOWED_METHODS
) -> list[tuple[bytes, bytes]]:
    """What a preflight's answer says: the page may send its request."""
    requested = headers.get(b"access-control-request-headers", DEFAULT_REQUEST_HEADERS)
    return [
        (b"access-control-allow-origin", origin),
        (b"access-control-allow-methods", methods),
        (b"access-control-allow-headers", requested),
        (b"access-control-max-age", PREFLIGHT_MAX_AGE),
        (b"vary", b"origin"),
    ]


def answer_headers(origin: bytes) -> list[tuple[bytes, bytes]]:
    """What lets the browser hand an answer (an error's too) to the page."""
    return [
        (b"access-control-allow-origin", origin),
        (b"access-control-expose-headers", EXPOSED_HEADERS),
        (b"vary", b"origin"),
    ]


async def answer_preflight(send: Send, origin: bytes, headers: dict[bytes, bytes]) -> None:
    fields = [*preflight_headers(origin, headers), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": fields})
    await send({"type": "http.response.body", "body": b""})


def with_cors_headers(send: Send, origin: bytes) -> Send:
    """`send` that adds the headers a browser needs to hand the answer to the page."""

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *answer_headers(origin)]}
        await send(message)

    return sending
