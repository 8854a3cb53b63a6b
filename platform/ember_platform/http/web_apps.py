"""The gateway's side of web-app endpoints (`@ember.asgi_app()`): any method and path
under the endpoint's URL goes to a replica as one input, and the app's response comes
back as it is sent: status and headers first, then the body's chunks, unbuffered."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial
from typing import Any

from ember.endpoints.asgi import (
    HttpRequest,
    decode_response_body,
    decode_response_start,
    decode_websocket_message,
    decode_whole_response,
    encode_websocket_message,
)
from ember.wire.labels import Route
from ember.wire.spec import FUNCTION_METHOD
from ember_platform.edge.asgi_types import Receive, Send
from ember_platform.edge.errors import HttpError
from ember_platform.http.call_plane import CallPlane
from ember_platform.http.call_requests import affinity_key
from ember_platform.http.caller_watch import CallerWatch
from ember_platform.observability.request_stats import RequestStats
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.runtime.inputs import END, ERROR, Input
from ember_platform.security.random_ids import random_token

Headers = list[tuple[bytes, bytes]]
CLIENT_GONE = 499
# How long an app may take to end its session after its caller closed the WebSocket,
# before the session's input is cancelled.
WEBSOCKET_CLOSE_GRACE_S = 5.0
# The close code for a session the platform ended: the app failed or could not start.
INTERNAL_ERROR_CLOSE = 1011


def app_path(scope: dict[str, Any], route: Route) -> str:
    """The request's path as the app sees it: under its root path, which the path must
    start with (a path with doubled slashes is rebuilt from what the route found)."""
    path = scope["path"]
    root = route.root_path
    if not root or path == root or path.startswith(root + "/"):
        return path
    return root + "/" + (route.method if route.explicit_method else "")


def forwarded_headers(headers: Headers, public: bool) -> Headers:
    """The request's headers for the app. A private endpoint's Authorization header holds
    an Ember token, which is the platform's, not the app's: it is not passed on."""
    if public:
        return list(headers)
    return [(k, v) for k, v in headers if k.lower() != b"authorization"]


def submit_app_input(
    cluster: CallPlane,
    scope: dict[str, Any],
    route: Route,
    runtime: EndpointRuntime,
    kind: str,
    body: bytes,
) -> Input:
    """Queue one request (or WebSocket session) for the app, as a streaming input; 503
    when no worker could ever run it."""
    reason = cluster.roster.unservable_reason(runtime)
    if reason is not None:
        raise HttpError(503, "no_capacity", f"{route.label}: {reason}")
    client = scope.get("client")
    path = app_path(scope, route)
    raw_path = scope.get("raw_path") if path == scope["path"] else None
    request = HttpRequest(
        method=scope.get("method", "GET"),
        path=path,
        root_path=route.root_path,
        query_string=scope.get("query_string", b""),
        headers=forwarded_headers(scope["headers"], runtime.settings.public),
        body=body,
        client=(str(client[0]), int(client[1])) if client else None,
        kind=kind,
        raw_path=raw_path if isinstance(raw_path, bytes) else None,
    )
    inp = Input(
        id="c-" + random_token(12),
        label=route.label,
        method=FUNCTION_METHOD,
        body=request.encode(),
        streaming=True,
        is_async=False,
        affinity=affinity_key(dict(scope["headers"])),  # sticky sessions, when asked
        canary=runtime.is_canary,
    )
    cluster.input_lifecycle.submit(inp)
    return inp


DISCONNECTED = "the caller disconnected"


def end_the_stream(cluster: CallPlane, inp: Input) -> None:
    """For a streamed answer whose caller left: cancel the input (its work in the
    replica stops) and end the stream being relayed."""
    cluster.input_lifecycle.cancel(inp, DISCONNECTED)
    inp.add_event(END, None)


class WebAppRelay:
    def __init__(self, cluster: CallPlane) -> None:
        self.cluster = cluster

    async def handle(
        self,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
        route: Route,
        runtime: EndpointRuntime,
        body: bytes,
    ) -> None:
        inp = submit_app_input(self.cluster, scope, route, runtime, "http", body)
        stats = RequestStats(inp.id, runtime.app, runtime.spec.name, scope["method"], True)
        status = CLIENT_GONE
        try:
            status = await self._relay(inp, receive, send, stats)
        finally:
            self.cluster.journal.request_finished(stats, inp, status)

    async def _relay(self, inp: Input, receive: Receive, send: Send, stats: RequestStats) -> int:
        """Send the app's response as its events arrive; returns the status the caller got."""
        watch = CallerWatch(receive, partial(end_the_stream, self.cluster, inp), inp.loop)
        status: int | None = None
        try:
            while True:
                kind, data = await self.cluster.streams.next_event(inp)
                if status is None:
                    if kind != END and kind != ERROR:
                        status, headers = decode_response_start(data or b"")
                        headers.append((b"x-ember-call-id", inp.id.encode()))
                        await send(
                            {"type": "http.response.start", "status": status, "headers": headers}
                        )
                        continue
                    if watch.gone:
                        return CLIENT_GONE
                    outcome = await inp.outcome
                    if outcome.status == 200:  # the whole response in one result
                        status, headers, body = decode_whole_response(bytes(outcome.body))
                        headers.append((b"x-ember-call-id", inp.id.encode()))
                        start = {"type": "http.response.start", "status": status}
                        await send({**start, "headers": headers})
                        await send({"type": "http.response.body", "body": body})
                        stats.note_event(b"")
                        return status
                    # Nothing sent yet: the platform's error, with its honest status.
                    await _send_error(send, outcome.status, bytes(outcome.body))
                    return outcome.status
                if kind == ERROR:
                    # An error after the start cannot change the status; the response is
                    # cut short (no last chunk), so that the caller cannot take a part for
                    # the whole, and the metrics count the error.
                    ended = inp.outcome.result() if inp.outcome.done() else None
                    return CLIENT_GONE if watch.gone else (ended.status if ended else 500)
                if kind == END:
                    await send({"type": "http.response.body", "body": b""})
                    break
                chunk = decode_response_body(data or b"")
                stats.note_event(b"")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            watch.close()
        if watch.gone:
            return CLIENT_GONE
        return status


class WebSocketRelay:
    """A WebSocket session with a web-app endpoint (its `websocket.connect` received): the
    caller's messages go to the replica running the app, the app's accept, sends and
    close come back to the caller."""

    def __init__(self, cluster: CallPlane) -> None:
        self.cluster = cluster

    async def handle(
        self,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
        route: Route,
        runtime: EndpointRuntime,
    ) -> None:
        inp = submit_app_input(self.cluster, scope, route, runtime, "websocket", b"")
        stats = RequestStats(inp.id, runtime.app, runtime.spec.name, "WEBSOCKET", True)
        status = CLIENT_GONE
        caller = asyncio.ensure_future(self._from_caller(inp, receive))
        try:
            status = await self._to_caller(inp, send, stats)
        finally:
            caller.cancel()
            self.cluster.journal.request_finished(stats, inp, status)

    async def _from_caller(self, inp: Input, receive: Receive) -> None:
        """The caller's messages to the app, then its close; if the app has not ended the
        session a while after that, the session's input is cancelled."""
        while True:
            message = await receive()
            if message["type"] == "websocket.receive":
                self.cluster.streams.send_to_input(inp, encode_websocket_message(message).encode())
            elif message["type"] == "websocket.disconnect":
                self.cluster.streams.send_to_input(inp, encode_websocket_message(message).encode())
                break
        try:
            await asyncio.wait_for(asyncio.shield(inp.outcome), WEBSOCKET_CLOSE_GRACE_S)
        except TimeoutError:
            self.cluster.input_lifecycle.cancel(inp, "the caller closed the WebSocket")

    async def _to_caller(self, inp: Input, send: Send, stats: RequestStats) -> int:
        """The app's messages to the caller; returns the status the session counts as:
        101 once accepted, else the platform's error (or 403 for an app that refused)."""
        accepted = closed = False
        while True:
            kind, data = await self.cluster.streams.next_event(inp)
            if kind in (END, ERROR):
                break
            message = decode_websocket_message(data or b"")
            if message["type"] == "websocket.accept" and not accepted:
                accepted = True
                await send(message)
            elif message["type"] == "websocket.send" and accepted and not closed:
                stats.note_event(b"")
                await send(message)
            elif message["type"] == "websocket.close" and not closed:
                closed = True
                await send(message)
        if closed:
            return 101 if accepted else 403
        outcome = await inp.outcome
        # The caller may be gone already: then there is no one to tell.
        with contextlib.suppress(OSError, RuntimeError):
            if accepted:  # the app ended (or failed) without closing: the platform closes
                code = 1000 if outcome.status == 200 else INTERNAL_ERROR_CLOSE
                await send({"type": "websocket.close", "code": code})
            else:
                status = outcome.status if outcome.status != 200 else 403
                await reject(send, status, bytes(outcome.body))
        if accepted:
            return 101 if outcome.status == 200 else outcome.status
        return outcome.status if outcome.status != 200 else 403


async def reject(send: Send, status: int, body: bytes) -> None:
    """Refuse a WebSocket handshake with an HTTP answer (the server's ASGI extension)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


async def _send_error(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
