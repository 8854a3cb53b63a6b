"""What an input's code returns or yields, sent as the channel carries it: a JSON value
(checked: JSON at all, no NaN, within one message's limit) or a file's bytes in base64;
a stream's events are all JSON values or all bytes, and an `end` closes the stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from ember.declarations.parameters import encode_bytes
from ember.declarations.structured import to_json
from ember.files import File, as_file
from ember.wire import messages as wire
from ember.wire.limits import MAX_FILE_RESULT_BYTES, MAX_RESULT_BYTES, MIB, RESULT_PIECE_BYTES
from ember_worker.replica.channel import Send


class ResultTooLargeError(Exception):
    """A result or stream event over what one channel message may carry."""


def encode_json(func: Callable[..., Any], value: Any) -> str:
    """`value`, what `func` returned or yielded, as the JSON text of one message."""
    name = getattr(func, "__qualname__", "the endpoint")
    try:
        # ASCII: as many bytes as characters; models and dataclasses as their JSON.
        # allow_nan=False: NaN and Infinity are not JSON; clients other than Python's
        # (browsers, Go, Rust) could not read the answer.
        text = json.dumps(value, default=to_json, allow_nan=False)
    except ValueError as exc:
        if "Out of range float" not in str(exc):
            raise TypeError(f"{name} returned a value that is not JSON: {exc}") from None
        raise TypeError(
            f"{name} returned NaN or Infinity, which JSON cannot hold: return None or a "
            "string for such a number"
        ) from None
    except TypeError as exc:
        raise TypeError(f"{name} returned a value that is not JSON-serializable: {exc}") from None
    if len(text) > MAX_RESULT_BYTES:
        raise ResultTooLargeError(
            f"{name} returned {len(text) / MIB:.1f} MiB of JSON, over the limit of "
            f"{MAX_RESULT_BYTES // MIB} MiB for one result or stream event: stream it "
            "in smaller events, or store it and return where it is"
        )
    return text


def check_file_size(func: Callable[..., Any], file: File) -> None:
    if len(file.data) > MAX_FILE_RESULT_BYTES:  # its base64 must fit a message
        raise ResultTooLargeError(
            f"{getattr(func, '__qualname__', 'the endpoint')} returned a file of "
            f"{len(file.data) / MIB:.1f} MiB, over the limit of "
            f"{MAX_FILE_RESULT_BYTES // MIB} MiB: yield it in smaller chunks from a "
            "generator"
        )


class ResultSender:
    def __init__(self, send: Send) -> None:
        self.send = send
        # Per streaming input: whether its items are bytes (a file) or JSON values.
        self._stream_is_file: dict[str, bool] = {}
        self._pieces = asyncio.Lock()  # a large result's pieces go together
        # Inputs run as a gang member's copy of rank 0's (`wire.Input.echo`): rank 0's
        # result is the answer, so theirs is not sent, only that they ended.
        self._echoes: set[str] = set()

    def echo(self, input_id: str) -> None:
        """The input is a copy: its values stay here; its end (or error) still goes."""
        self._echoes.add(input_id)

    async def result(self, input_id: str, func: Callable[..., Any], result: Any) -> None:
        """A call's one answer: a JSON value, or a file (`ember.File`, bytes) that the
        control plane answers with as it is."""
        if input_id in self._echoes:
            await self.send(wire.End(id=input_id))
            return
        await self._send_value(wire.Result, input_id, func, result)

    async def event(self, input_id: str, func: Callable[..., Any], item: Any) -> None:
        """One item of a stream: a JSON value (a server-sent event), or bytes (a chunk of
        a stream that is a file: see `ember.files`)."""
        file = as_file(item)
        is_file = self._stream_is_file.setdefault(input_id, file is not None)
        if is_file != (file is not None):
            raise TypeError(
                f"{getattr(func, '__qualname__', 'the endpoint')} yielded "
                f"{'bytes after JSON values' if file else 'a JSON value after bytes'}: a "
                "stream is all bytes (a file) or all JSON values (events)"
            )
        if input_id not in self._echoes:
            await self._send_value(wire.Event, input_id, func, item)

    async def end(self, input_id: str) -> None:
        """The input's stream has no more events."""
        await self.send(wire.End(id=input_id))

    def forget(self, input_id: str) -> None:
        """The input has ended."""
        self._stream_is_file.pop(input_id, None)
        self._echoes.discard(input_id)

    async def _send_value(
        self,
        kind: type[wire.Result | wire.Event],
        input_id: str,
        func: Callable[..., Any],
        value: Any,
    ) -> None:
        file = as_file(value)
        if file is None:
            header, body = kind(id=input_id), encode_json(func, value)
        else:
            check_file_size(func, file)
            # A file's media type (and name) beside its base64 body.
            header = kind(id=input_id, media_type=file.media_type, filename=file.filename)
            body = encode_bytes(file.data)
        if kind is not wire.Result or len(body) <= RESULT_PIECE_BYTES:
            await self.send(header, body)
            return
        # One large result's pieces at a time: the control plane may pause the channel
        # between whole results, never within one, so each is whole before the next starts.
        async with self._pieces:
            last = (len(body) - 1) // RESULT_PIECE_BYTES * RESULT_PIECE_BYTES
            for at in range(0, last, RESULT_PIECE_BYTES):
                await self.send(wire.ResultPart(id=input_id), body[at : at + RESULT_PIECE_BYTES])
            await self.send(header, body[last:])
