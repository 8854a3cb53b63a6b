"""An OpenAI Batch API input file read into its requests, pure: each line checked on its
own (one that is wrong fails alone, in the error file), a `custom_id` used twice failing
the whole batch, as OpenAI's validation does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from ember.wire.batch_lines import BatchLineError, decode_batch_line

MAX_MESSAGE = 300  # characters of a line's error: a line's own text is not echoed whole


@dataclass(frozen=True)
class BatchRequest:
    index: int  # of the requests, from 0: its call's id ends with it
    line: int  # in the file, from 1
    custom_id: str
    body: bytes  # the request's body, as JSON


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str


@dataclass
class InputFile:
    requests: list[BatchRequest] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)  # lines that fail alone
    duplicate: LineError | None = None  # a custom_id used twice: the batch fails

    @property
    def total(self) -> int:
        """Lines the batch answers: each request, and each line that failed alone."""
        return len(self.requests) + len(self.errors)


class TooManyLines(ValueError):
    """More lines than a batch takes: the file is read no further."""


def read_input_file(data: bytes, endpoint: str, max_lines: int) -> InputFile:
    """The file's requests for `endpoint` (a path such as "/v1/chat/completions"); blank
    lines are skipped. TooManyLines past `max_lines` lines, read no further: what a file
    costs to read is bounded by the limit, not by its size."""
    parsed = InputFile()
    seen: dict[str, int] = {}
    counted = 0
    for number, raw in enumerate(_lines(data), start=1):
        if not raw.strip():
            continue
        counted += 1
        if counted > max_lines:
            raise TooManyLines(f"the file holds more than {max_lines} requests")
        try:
            line = decode_batch_line(raw)
        except BatchLineError as error:
            message = str(error)[:MAX_MESSAGE]
            parsed.errors.append(LineError(number, None, error.code, message))
            continue
        if line.custom_id in seen:
            parsed.duplicate = LineError(
                number,
                line.custom_id,
                "duplicate_custom_id",
                f"custom_id {line.custom_id!r} of line {number} is that of line "
                f"{seen[line.custom_id]}: each request needs its own",
            )
            return parsed
        seen[line.custom_id] = number
        problem = _problem(line.method, line.url, line.body, endpoint)
        if problem is not None:
            parsed.errors.append(LineError(number, line.custom_id, *problem))
            continue
        body = json.dumps(line.body).encode()
        parsed.requests.append(BatchRequest(len(parsed.requests), number, line.custom_id, body))
    return parsed


def _lines(data: bytes) -> Iterator[bytes]:
    """The file's lines one at a time (a list of them all would cost the file again)."""
    start = 0
    while start <= len(data):
        end = data.find(b"\n", start)
        if end < 0:
            end = len(data)
        yield data[start:end]
        start = end + 1


def _problem(
    method: str, url: str, body: dict[str, object], endpoint: str
) -> tuple[str, str] | None:
    if not method or method.upper() != "POST":
        return "invalid_method", f"method {method!r}: batch requests are POSTs"
    if url != endpoint:
        return "invalid_url", f"url {url!r} is not the batch's endpoint {endpoint}"
    if body.get("stream") is True:
        return "invalid_request", "a batch request is answered whole: leave out stream"
    return None
