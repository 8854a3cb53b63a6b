"""A web-app endpoint's inputs: each an HTTP request run through the app (ASGI, or WSGI
through its bridge), its response sent as it comes (one frame when it is small and
whole), or a WebSocket session whose caller's messages arrive in an inbox."""

from __future__ import annotations

import asyncio
from typing import Any

from ember.endpoints.asgi import (
    RESPONSE_CHUNK_BYTES,
    HttpRequest,
    decode_websocket_message,
    encode_websocket_message,
    response_body_events,
    response_start_event,
    whole_response,
)
from ember.wire import messages as wire
from ember.wire.limits import MAX_RESULT_BYTES, MIB
from ember_worker.replica.channel import Send
from ember_worker.replica.results import ResultTooLargeError
from ember_worker.replica.user_code import UserCode


class WebRequests:
    def __init__(self, code: UserCode, send: Send) -> None:
        self.code = code  # its web app, and the state the app's lifespan set
        self.send = send
        self.inboxes: dict[str, asyncio.Queue[str]] = {}  # WebSocket sessions' messages

    def inbox(self, input_id: str) -> asyncio.Queue[str]:
        """Where the caller's messages to a WebSocket session wait for the app."""
        inbox = self.inboxes.get(input_id)
        if inbox is None:
            inbox = self.inboxes[input_id] = asyncio.Queue()
        return inbox

    def forget(self, input_id: str) -> None:
        """The input has ended: its inbox goes."""
        self.inboxes.pop(input_id, None)

    async def serve(self, input_id: str, body: str) -> None:
        """Run the web app on one request; its response goes out as it is sent."""
        request = HttpRequest.decode(body)
        if request.kind == "websocket":
            await self._serve_websocket(input_id, request)
            return
        delivered = False
        start: dict[str, Any] | None = None  # the app's response start, held back
        streaming = answered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            # The one body message was given; the next is the caller leaving, which
            # cancels this task instead (no work left running for nobody).
            await asyncio.Future()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal start, streaming, answered
            if message["type"] == "http.response.start" and start is None:
                start = message
            elif message["type"] == "http.response.body" and start is not None and not answered:
                body = message.get("body", b"")
                last = not message.get("more_body", False)
                if not streaming and last and len(body) <= RESPONSE_CHUNK_BYTES:
                    # The whole response in one message (most answers): one frame.
                    answered = True
                    whole = whole_response(start["status"], start.get("headers", []), body)
                    await self.send(wire.Result(id=input_id), whole)
                    return
                if not streaming:
                    streaming = True
                    event = response_start_event(start["status"], start.get("headers", []))
                    await self.send(wire.Event(id=input_id), event)
                for event in response_body_events(body):
                    await self.send(wire.Event(id=input_id), event)

        await self.code.web_app(self._app_scope(request), receive, send)
        if start is None:
            raise RuntimeError("the web app returned without sending a response")
        if not answered:
            if not streaming:  # a start and no body message: an empty body
                whole = whole_response(start["status"], start.get("headers", []), b"")
                await self.send(wire.Result(id=input_id), whole)
                return
            await self.send(wire.End(id=input_id))

    async def _serve_websocket(self, input_id: str, request: HttpRequest) -> None:
        """Run the web app on one WebSocket session: `websocket.connect`, then the caller's
        messages as they come; what the app sends goes out as stream events."""
        inbox = self.inbox(input_id)
        connected = False

        async def receive() -> dict[str, Any]:
            nonlocal connected
            if not connected:
                connected = True
                return {"type": "websocket.connect"}
            return decode_websocket_message(await inbox.get())

        async def send(message: dict[str, Any]) -> None:
            text = encode_websocket_message(message)
            if len(text) > MAX_RESULT_BYTES:
                raise ResultTooLargeError(
                    f"a WebSocket message of {len(text) / MIB:.1f} MiB (in base64 for bytes) is "
                    f"over the limit of {MAX_RESULT_BYTES // MIB} MiB for one message"
                )
            await self.send(wire.Event(id=input_id), text)

        await self.code.web_app(self._app_scope(request), receive, send)
        await self.send(wire.End(id=input_id))

    def _app_scope(self, request: HttpRequest) -> dict[str, Any]:
        """The request's scope, with a copy of the state the app's lifespan set."""
        scope = request.scope()
        if self.code.lifespan is not None:
            scope["state"] = dict(self.code.lifespan.state)
        return scope
