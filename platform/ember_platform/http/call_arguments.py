"""A call's keyword arguments from its HTTP request, as the JSON object the replica gets.

- a JSON object body (any content type but those below, as `curl -d` sends it);
- `multipart/form-data`: each field an argument; files become bytes, `application/json`
  parts JSON values, other text converted by the parameter's kind;
- a body of any other media type (`image/png`, `application/octet-stream`, …): the
  method's one `bytes` parameter, the query string giving the others;
- GET: the query string, converted by the parameters' kinds.

Bytes travel as base64 strings (`ember.declarations.parameters`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Any
from urllib.parse import parse_qsl

from ember.declarations.argcheck import ArgumentTypeError
from ember.declarations.parameters import encode_bytes, from_text
from ember.wire.spec import MethodSpec
from ember_platform.edge.errors import HttpError

# Bodies read as a JSON object whatever they say: curl's -d says form-urlencoded.
JSON_MEDIA_TYPES = ("", "application/json", "application/x-www-form-urlencoded", "text/plain")
MULTIPART = "multipart/form-data"
MAX_FORM_FIELDS = 1000
MAX_PART_HEAD_BYTES = 8192  # a part's headers (a name, a file name, a type)


def _bad(message: str) -> HttpError:
    return HttpError(400, "invalid_arguments", message)


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def parse_arguments(
    spec: MethodSpec, http_method: str, content_type: str, body: bytes, query: bytes
) -> bytes:
    """The call's keyword arguments as JSON text (UTF-8)."""
    if http_method == "GET":
        return _dump(_query_arguments(spec, query))
    kind = media_type(content_type)
    if kind in JSON_MEDIA_TYPES or kind.endswith("+json"):
        if not query:
            return _json_object(body)  # as it came: the common case, parsed only to check
        arguments = _query_arguments(spec, query)
        for name, value in json.loads(_json_object(body)).items():
            if name in arguments:
                raise _bad(f"argument {name!r} is given twice (the body and the query string)")
            arguments[name] = value
        return _dump(arguments)
    arguments = _query_arguments(spec, query)
    if kind == MULTIPART:
        fields = form_fields(content_type, body)
        for name, value in _form_arguments(spec, fields):
            if name in arguments:
                raise _bad(f"argument {name!r} is given twice")
            arguments[name] = value
        return _dump(arguments)
    return _dump(_with_raw_body(spec, arguments, body, kind))


def _dump(arguments: dict[str, Any]) -> bytes:
    try:
        return json.dumps(arguments, allow_nan=False).encode()
    except ValueError:  # a form's JSON part with NaN in it
        raise _bad("NaN and Infinity are not JSON numbers: send null or a string") from None


def _json_object(body: bytes) -> bytes:
    if not body.strip():
        return b"{}"
    try:
        # UTF-8 only (RFC 8259): the body travels on to the replica as UTF-8 text.
        value = json.loads(
            body.decode("utf-8"), parse_constant=_not_json, parse_float=_finite_float
        )
    except UnicodeDecodeError:
        raise HttpError(400, "invalid_json", "the body must be UTF-8 encoded JSON") from None
    except ValueError as exc:
        raise HttpError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise HttpError(400, "invalid_json", "the body's JSON is nested too deeply") from None
    if not isinstance(value, dict):
        raise _bad('the body must be a JSON object of keyword arguments, e.g. {"text": "hi"}')
    return body


def _not_json(constant: str) -> Any:
    # Python's json reads NaN and Infinity; they are not JSON, and clients in other
    # languages could not read them back.
    raise ValueError(f"{constant} is not a JSON number (RFC 8259): send null or a string")


def _finite_float(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text} is too large for a 64-bit float")
    return number


def _converted(spec: MethodSpec, name: str, text: str) -> Any:
    try:
        return from_text(spec.parameters.get(name), name, text)
    except ArgumentTypeError as exc:
        raise _bad(str(exc)) from None


def _query_arguments(spec: MethodSpec, query: bytes) -> dict[str, Any]:
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)  # ?text= is ""
    return {name: _converted(spec, name, text) for name, text in pairs}


def _with_raw_body(
    spec: MethodSpec, arguments: dict[str, Any], body: bytes, kind: str
) -> dict[str, Any]:
    targets = spec.bytes_parameters()
    if len(targets) != 1:
        has = "no bytes parameter" if not targets else f"bytes parameters {targets}"
        raise HttpError(
            415,
            "unsupported_media_type",
            f"a body of type {kind} goes to the method's one bytes parameter, and {spec.name} has "
            f"{has}: send a JSON object, or multipart/form-data with a field per argument",
        )
    (target,) = targets
    if target in arguments:
        raise _bad(f"argument {target!r} is given twice (the body and the query string)")
    arguments[target] = encode_bytes(body)
    return arguments


@dataclass(frozen=True)
class FormField:
    """One part of a multipart/form-data body."""

    name: str
    data: bytes
    filename: str | None
    content_type: str

    def is_text(self) -> bool:
        """A plain field, not a file: without a file name, of a text media type."""
        kind = media_type(self.content_type)
        return self.filename is None and (kind == "" or kind.startswith("text/"))


def _form_arguments(spec: MethodSpec, fields: list[FormField]) -> list[tuple[str, Any]]:
    arguments = []
    for field in fields:
        kind = media_type(field.content_type)
        if field.filename is None and (kind == "application/json" or kind.endswith("+json")):
            try:
                value = json.loads(field.data.decode("utf-8"))
            except ValueError:
                raise _bad(f"form field {field.name!r} is not valid UTF-8 JSON") from None
        elif field.is_text():
            try:
                text = field.data.decode("utf-8")
            except UnicodeDecodeError:
                raise _bad(f"form field {field.name!r} is not UTF-8 text") from None
            value = _converted(spec, field.name, text)
        else:
            value = encode_bytes(field.data)
        arguments.append((field.name, value))
    return arguments


def _header_params(value: str) -> EmailMessage:
    """A header with its parameters parsed (quoted strings, RFC 2231 names)."""
    message = EmailMessage()
    try:
        message["content-disposition"] = value
    except ValueError as error:  # a line break in a parameter, say
        raise _bad(f"a multipart part's Content-Disposition is malformed: {error}") from None
    return message


def form_fields(content_type: str, body: bytes) -> list[FormField]:
    """The fields of a multipart/form-data body (RFC 7578)."""
    if len(content_type) > MAX_PART_HEAD_BYTES:  # parsing a header's parameters costs more
        raise _bad(f"a multipart Content-Type is at most {MAX_PART_HEAD_BYTES} bytes")
    header = EmailMessage()
    try:
        header["content-type"] = content_type
    except ValueError as error:  # a line break in it
        raise _bad(f"the multipart Content-Type is malformed: {error}") from None
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise _bad("a multipart/form-data body needs a boundary in its Content-Type")
    try:
        delimiter = b"--" + boundary.encode("latin-1")
    except UnicodeEncodeError:  # an RFC 2231 boundary*= with characters past Latin-1
        raise _bad("a multipart boundary must be ASCII (RFC 2046)") from None
    start = body.find(delimiter)
    if start < 0:
        raise _bad("the multipart body has no part")
    position = start + len(delimiter)
    fields: list[FormField] = []
    while True:
        if body.startswith(b"--", position):
            return fields  # the close delimiter
        if not body.startswith(b"\r\n", position):
            raise _bad("the multipart body is malformed (a delimiter without CRLF)")
        head_end = body.find(b"\r\n\r\n", position)
        end = body.find(b"\r\n" + delimiter, head_end + 4 if head_end >= 0 else position)
        if head_end < 0 or end < 0:
            raise _bad("the multipart body is cut short")
        if head_end - position > MAX_PART_HEAD_BYTES:
            raise _bad(f"a multipart part's headers are at most {MAX_PART_HEAD_BYTES} bytes")
        fields.append(_field(body[position + 2 : head_end], body[head_end + 4 : end]))
        if len(fields) > MAX_FORM_FIELDS:
            raise _bad(f"a form may have at most {MAX_FORM_FIELDS} fields")
        position = end + 2 + len(delimiter)


def _field(head: bytes, data: bytes) -> FormField:
    headers: dict[str, str] = {}
    for line in head.decode("utf-8", "replace").split("\r\n"):
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    disposition = _header_params(headers.get("content-disposition", ""))
    name = disposition.get_param("name", header="content-disposition")
    if disposition.get_content_disposition() != "form-data" or not isinstance(name, str):
        raise _bad("each multipart part needs Content-Disposition: form-data; name=...")
    filename = disposition.get_filename()
    return FormField(name, data, filename, headers.get("content-type", ""))
