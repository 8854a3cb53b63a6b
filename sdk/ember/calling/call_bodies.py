"""A call as the SDK sends it and its answer as the SDK gives it back: keyword arguments as
a JSON body (`bytes` values as base64 strings, which the replica decodes for `bytes`
parameters), and an answer as its JSON value or a file's bytes (`ReceivedFile`: bytes
that know their media type and name)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ember.calling.tracing import TRACEPARENT_HEADER, current_traceparent
from ember.cancellation import PARENT_CALL_HEADER, current_call_id
from ember.declarations.parameters import json_default
from ember.errors import InvalidError
from ember.files import received_file

if TYPE_CHECKING:
    import httpx  # a type only: replicas that call nothing never load the HTTP client


def call_body(kwargs: Mapping[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """httpx arguments that send a call's keyword arguments: a JSON object, with `bytes`
    values as base64 (which the replica decodes for `bytes` parameters). Made while an
    input runs (an endpoint calling another), the call names that input as its parent."""
    try:
        # allow_nan=False: the platform refuses NaN and Infinity (not JSON); said here first.
        content = json.dumps(
            kwargs, default=json_default, separators=(",", ":"), allow_nan=False
        ).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidError(f"the call's arguments cannot be sent as JSON: {exc}") from None
    fields = {"Content-Type": "application/json", **(headers or {})}
    parent = current_call_id()
    if parent is not None:
        fields[PARENT_CALL_HEADER] = parent
    traceparent = current_traceparent()
    if traceparent is not None:  # the call is a span of the input's trace
        fields[TRACEPARENT_HEADER] = traceparent
    return {"content": content, "headers": fields}


def answer_value(response: httpx.Response) -> Any:
    """A call's answer: its JSON value, or the bytes of a file result (any other media
    type: an endpoint that returned `bytes` or an `ember.File`)."""
    content_type = response.headers.get("content-type", "application/json")
    media = content_type.split(";", 1)[0].strip()
    if media == "application/json" or media.endswith("+json"):
        return response.json()
    return received_file(
        response.content, content_type, response.headers.get("content-disposition")
    )
