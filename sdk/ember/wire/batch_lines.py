"""A line of an OpenAI Batch API input file, as a tenant uploads it: decoded only through
`decode_batch_line`, which checks its shape before the control plane reads a field."""

from __future__ import annotations

from typing import Any

import msgspec


class BatchLine(msgspec.Struct, forbid_unknown_fields=True):
    """`{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`"""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchLineError(ValueError):
    """The line is not JSON, or not a request's shape: `code` says which, as OpenAI's do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_DECODER = msgspec.json.Decoder(BatchLine)


def decode_batch_line(line: bytes) -> BatchLine:
    try:
        return _DECODER.decode(line)
    except msgspec.ValidationError as error:
        raise BatchLineError(
            "invalid_request", f"the line is not a batch request: {error}"
        ) from None
    except msgspec.DecodeError as error:
        raise BatchLineError("invalid_json_line", f"the line is not JSON: {error}") from None
    except RecursionError:
        raise BatchLineError("invalid_request", "the line nests too deep") from None
