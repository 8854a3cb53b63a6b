"""What kind of value each parameter of an endpoint takes, read from its type hints at
deploy time, so that the gateway can turn text (a query string, a form field) and files
(multipart parts, a raw request body) into the JSON arguments the replica expects.

`bytes` parameters travel as base64 strings inside the JSON arguments: JSON callers send
them so, the SDK encodes `bytes` values so (calling/call_bodies.py), and the gateway
encodes uploaded files so. The replica decodes them before the code runs."""

from __future__ import annotations

import base64
import binascii
import collections.abc
import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ember.declarations.argcheck import ArgumentTypeError, parameter_hints
from ember.declarations.structured import to_json

BYTES = "bytes"
INT = "int"
FLOAT = "float"
BOOL = "bool"
STR = "str"
JSON = "json"  # lists, objects and the like: a text value is parsed as JSON

_SCALARS = {bytes: BYTES, int: INT, float: FLOAT, bool: BOOL, str: STR}
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parameter_kind(hint: Any) -> str | None:
    """The kind of value `hint` asks for; None for hints that say nothing useful (`Any`):
    a text value for such a parameter stays text."""
    if hint is Any:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [h for h in typing.get_args(hint) if h is not type(None)]
        return _one_kind({parameter_kind(option) for option in options})
    if origin is typing.Literal:
        return _one_kind({_SCALARS.get(type(option), JSON) for option in typing.get_args(hint)})
    if isinstance(hint, type) and hint in _SCALARS:
        return _SCALARS[hint]
    return JSON


def _one_kind(kinds: set[str | None]) -> str | None:
    """The kind of a union of these: text stays text where text may do."""
    if len(kinds) == 1:
        return kinds.pop()
    return None if STR in kinds or None in kinds else JSON


def parameter_kinds(func: Callable[..., Any]) -> dict[str, str]:
    """Kinds of the named parameters of `func` that have hints; {} when its hints cannot
    be resolved."""
    hints = parameter_hints(func)
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return {}
    kinds = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        kind = parameter_kind(hints[parameter.name]) if parameter.name in hints else None
        if kind is not None:
            kinds[parameter.name] = kind
    return kinds


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_bytes(name: str, value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ArgumentTypeError(
            f"{name}: expected bytes, as a base64 string in JSON (or a file in a "
            "multipart/form-data body)"
        ) from None


def holds_bytes(hint: Any) -> bool:
    """Whether a value of this hint may hold `bytes` somewhere: `bytes`, `list[bytes]`,
    `dict[str, bytes]`, `bytes | None` and the like, each of which JSON carries as base64."""
    if hint is bytes:
        return True
    return any(holds_bytes(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)


def decode_nested_bytes(hint: Any, value: Any, where: str) -> Any:
    """`value` with the base64 strings that stand for `bytes` in its hint decoded, at any
    depth of lists, tuples and dicts; what the hint leaves open (a union of bytes and
    str) stays as it came, for the argument check to judge."""
    if hint is bytes:
        return decode_bytes(where, value) if isinstance(value, str) else value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1 and value is not None:
            return decode_nested_bytes(options[0], value, where)
        return value
    if not isinstance(value, list | dict) or not args:
        return value
    if isinstance(value, dict):
        if origin not in (dict, Mapping, collections.abc.MutableMapping) or len(args) != 2:
            return value
        return {k: decode_nested_bytes(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(args) != len(value):
            return value  # the argument check says what is wrong
        return [
            decode_nested_bytes(a, v, f"{where}[{i}]")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        ]
    item = args[0]
    return [decode_nested_bytes(item, v, f"{where}[{i}]") for i, v in enumerate(value)]


def from_text(kind: str | None, name: str, text: str) -> Any:
    """A query-string or form-field value as the JSON value its parameter takes."""
    if kind in (None, STR):
        return text
    if kind == BYTES:
        return encode_bytes(text.encode("utf-8"))
    if kind == BOOL:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ArgumentTypeError(f"{name}: expected true or false, got {text!r}")
    try:
        if kind == INT:
            return int(text)
        if kind == FLOAT:
            number = float(text)
            if not math.isfinite(number):  # not JSON: clients elsewhere cannot read it
                raise ArgumentTypeError(f"{name}: expected a finite number, got {text!r}")
            return number
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        expected = "JSON" if kind == JSON else kind
        raise ArgumentTypeError(f"{name}: expected {expected}, got {text!r}") from None


def _no_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def json_default(value: Any) -> Any:
    """For `json.dumps(..., default=json_default)`: bytes as base64 strings, Pydantic
    models and dataclasses as their JSON form."""
    if isinstance(value, bytes | bytearray | memoryview):
        return encode_bytes(bytes(value))
    return to_json(value)
