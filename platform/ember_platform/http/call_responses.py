"""What a call's caller gets back over raw ASGI: whole responses, a spawn's 202, a result,
and a stream relayed event by event (server-sent events, or a file's bytes)."""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

from ember.calling.tracing import TRACE_ID_HEADER
from ember.wire.spec import STREAM_DONE
from ember.wire.sse import encode_event
from ember_platform.edge.asgi_types import Receive, Send
from ember_platform.http.call_plane import CallPlane
from ember_platform.http.caller_watch import CallerWatch
from ember_platform.http.web_apps import DISCONNECTED, end_the_stream
from ember_platform.observability.request_stats import RequestStats
from ember_platform.runtime.inputs import CHUNK, END, ERROR, JSON_MEDIA_TYPE, Input, Outcome

JSON_CONTENT_TYPE = (b"content-type", b"application/json")
CLIENT_GONE = 499  # the status of a request whose caller left before its answer
CALLS_PATH = "/v1/calls"  # a spawned call's status URL is under it, in the API
BODY_PIECE_BYTES = 1024 * 1024


class StreamCutShort(Exception):
    """A streamed file failed midway: its response ends without its last chunk."""


async def send_json(
    send: Send, status: int, body: bytes | bytearray, extra: dict[str, str] | None = None
) -> None:
    await send_body(send, status, body, extra, JSON_CONTENT_TYPE)


async def send_body(
    send: Send,
    status: int,
    body: bytes | bytearray,
    fields: dict[str, str] | None,
    first: tuple[bytes, bytes] | None = None,
) -> None:
    """A whole response: `first` (an encoded header, the hot path's), then `fields`."""
    headers = [(b"content-length", str(len(body)).encode())]
    if first is not None:
        headers.append(first)
    for key, value in (fields or {}).items():
        headers.append((key.lower().encode(), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if len(body) <= BODY_PIECE_BYTES:  # the hot path
        await send({"type": "http.response.body", "body": body})
        return
    # A large body goes in pieces, the loop free between them: encrypting 60 MB at once
    # would hold every other call up for tens of milliseconds.
    view = memoryview(body)
    for at in range(0, len(body), BODY_PIECE_BYTES):
        piece = bytes(view[at : at + BODY_PIECE_BYTES])
        more = at + BODY_PIECE_BYTES < len(body)
        await send({"type": "http.response.body", "body": piece, "more_body": more})
        await asyncio.sleep(0)


async def send_accepted(send: Send, call_id: str, headers: dict[str, str] | None = None) -> None:
    """202 for an async call: its id and where to ask for its result. The URL is relative
    to the URL called: the calls API answers it on the platform's host and on the
    endpoint's own (`Gateway.owns_v1_path`), so a browser page reads and cancels its call
    at the origin it called."""
    location = f"{CALLS_PATH}/{call_id}"
    body = json.dumps({"call_id": call_id, "status_url": location}).encode()
    await send_json(send, 202, body, {"Location": location, **(headers or {})})


async def send_outcome(send: Send, inp: Input, outcome: Outcome) -> None:
    """A call's result: its JSON (the hot path), or a file with its own headers."""
    ids = {"X-Ember-Call-Id": inp.id}
    if inp.trace is not None:
        ids[TRACE_ID_HEADER] = inp.trace.trace_id
    if outcome.media_type == JSON_MEDIA_TYPE and outcome.filename is None:  # the hot path
        await send_json(send, outcome.status, outcome.body, ids)
    else:  # a file
        await send_body(send, outcome.status, outcome.body, {**outcome.headers(), **ids})


async def outcome_unless_gone(cluster: CallPlane, inp: Input, receive: Receive) -> Outcome | None:
    """Wait for the outcome; if the caller hangs up first, cancel the input (no work
    is left running for nobody) and return None."""
    hung_up = partial(cluster.input_lifecycle.cancel, inp, DISCONNECTED)
    with CallerWatch(receive, hung_up, inp.loop) as watch:
        outcome = await inp.outcome  # the cancel above ends it too
    return None if watch.gone else outcome


def _error_event(inp: Input, body: bytes) -> bytes:
    """The event a stream that failed midway ends with: its error, with the status the
    call would have had had it failed before its first event (504, 400, 502, ...)."""
    status = inp.outcome.result().status if inp.outcome.done() else 500
    try:
        payload = json.loads(body)
        payload["error"]["status"] = status
        text = json.dumps(payload)
    except (ValueError, KeyError, TypeError):
        text = body.decode(errors="replace")
    return encode_event(text, "error")


def _stream_start(inp: Input, *, as_file: bool) -> dict[str, Any]:
    if as_file and inp.file is not None:
        media_type, filename = inp.file
        fields = Outcome(200, b"", media_type, filename).headers()
    else:
        fields = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    fields["X-Ember-Call-Id"] = inp.id
    if inp.trace is not None:
        fields[TRACE_ID_HEADER] = inp.trace.trace_id
    headers = [(key.lower().encode(), value.encode("latin-1")) for key, value in fields.items()]
    return {"type": "http.response.start", "status": 200, "headers": headers}


async def relay_stream(
    cluster: CallPlane,
    inp: Input,
    receive: Receive,
    send: Send,
    stats: RequestStats,
    *,
    done: bool = False,
) -> int:
    """Relay the events as they come; returns the status the caller got. JSON events
    go as server-sent events; a stream of bytes (a file) goes as the body itself.
    `done`: a stream that ended well ends with OpenAI's `data: [DONE]`."""
    # Watch for the caller leaving so the generator in the replica is closed.
    watch = CallerWatch(receive, partial(end_the_stream, cluster, inp), inp.loop)
    started = failed = False
    try:
        while True:
            kind, data = await cluster.streams.next_event(inp)
            if not started:
                if kind == ERROR:
                    # Nothing streamed yet: an honest status code is still possible.
                    outcome = await inp.outcome
                    await send_json(send, outcome.status, outcome.body)
                    return outcome.status
                started = True
                await send(_stream_start(inp, as_file=kind == CHUNK))
            if kind == END:
                break
            if inp.file is not None:
                if kind != CHUNK:
                    # A file's body has no place for an error: the caller sees the
                    # response cut short, and the log says why.
                    raise StreamCutShort
                await send({"type": "http.response.body", "body": data, "more_body": True})
                stats.note_event(b"")
                continue
            if kind == ERROR:
                await send(
                    {
                        "type": "http.response.body",
                        "body": _error_event(inp, data or b""),
                        "more_body": True,
                    }
                )
                failed = True
                break
            await send(
                {
                    "type": "http.response.body",
                    "body": encode_event((data or b"").decode()),
                    "more_body": True,
                }
            )
            stats.note_event(data or b"")
        last = encode_event(STREAM_DONE) if done and not failed and inp.file is None else b""
        await send({"type": "http.response.body", "body": last})
    except StreamCutShort:
        return inp.outcome.result().status if inp.outcome.done() else 500
    finally:
        watch.close()
    if watch.gone:
        return CLIENT_GONE  # the caller left mid-stream
    if failed:  # the stream ended with an error event: count the error's status
        return inp.outcome.result().status if inp.outcome.done() else 500
    return 200
