"""JSON Schemas of a method's arguments and result, read from its type hints at deploy
time (`EndpointDefinition.spec`), for the OpenAPI document the platform serves of each
endpoint.

The hints translated are those `ember.argcheck` checks (what JSON can carry), Pydantic
models (their own schemas) and dataclasses; any other hint is a schema that allows any
value, as the replica does not check it either. A
parameter's default goes into its schema when it is a JSON value."""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from ember.argcheck import parameter_hints
from ember.files import File
from ember.structured import is_dataclass_type, is_model

Schema = dict[str, Any]

_UNION_TYPES = (typing.Union, types.UnionType)
_SCALARS: dict[Any, Schema] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    bytes: {"type": "string", "contentEncoding": "base64"},
}
_LISTS = (list, Sequence, typing.Sequence, set, frozenset)
_MAPPINGS = (dict, Mapping, typing.Mapping)
_ITERATORS = (
    Iterator,
    typing.Iterator,
    typing.Generator,
    AsyncIterator,
    typing.AsyncIterator,
    typing.AsyncGenerator,
    typing.Iterable,
    typing.AsyncIterable,
)
# Deep enough for any real hint; a deeper one is left unchecked rather than recursed into.
MAX_DEPTH = 12
MAX_DOC_CHARS = 4000

# What a result that is a file (bytes or ember.File) is, in a schema.
FILE_RESULT: Schema = {"type": "string", "format": "binary"}


def hint_schema(hint: Any, depth: int = 0) -> Schema:
    """The JSON Schema of values that fit `hint` ({}: any value)."""
    if depth > MAX_DEPTH or hint is Any or hint is typing.Any:
        return {}
    if hint is None:
        hint = type(None)
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in _UNION_TYPES:
        options = [hint_schema(option, depth + 1) for option in args]
        return {} if {} in options else {"anyOf": options}
    if origin is typing.Literal:
        values = [v for v in args if v is None or isinstance(v, str | int | float | bool)]
        return {"enum": values}
    if is_model(hint):
        return model_schema(hint)
    if is_dataclass_type(hint):
        return _dataclass_schema(hint, depth)
    container = origin or hint
    if container is tuple:
        if args and args[-1] is not Ellipsis:  # tuple[int, str]
            items = [hint_schema(item, depth + 1) for item in args]
            return {
                "type": "array",
                "prefixItems": items,
                "minItems": len(items),
                "maxItems": len(items),
            }
        return _array(args[0] if args else Any, depth)
    if container in _LISTS:
        return _array(args[0] if args else Any, depth)
    if container in _MAPPINGS:
        schema: Schema = {"type": "object"}
        if len(args) == 2 and (value_schema := hint_schema(args[1], depth + 1)):
            schema["additionalProperties"] = value_schema
        return schema
    return {}


def model_schema(model: Any) -> Schema:
    """A Pydantic model's own JSON Schema, its `$defs` references put in place so that
    it stands alone inside another document ({} if the model cannot give one)."""
    try:
        schema = model.model_json_schema()
    except Exception:  # a model whose schema Pydantic cannot make (arbitrary types)
        return {}
    definitions = schema.pop("$defs", {})

    def inline(node: Any, depth: int) -> Any:
        if isinstance(node, list):
            return [inline(item, depth) for item in node]
        if not isinstance(node, dict):
            return node
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith("#/$defs/"):
            target = definitions.get(reference.removeprefix("#/$defs/"))
            # A model that holds itself is cut at the depth limit: any value there.
            return {} if target is None or depth > MAX_DEPTH else inline(target, depth + 1)
        return {key: inline(value, depth) for key, value in node.items()}

    return inline(schema, 0)


def _dataclass_schema(cls: Any, depth: int) -> Schema:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable forward reference: fields of any value
        hints = {}
    properties: dict[str, Schema] = {}
    required: list[str] = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        schema = hint_schema(hints.get(field.name, Any), depth + 1)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            required.append(field.name)
        elif _json_value(field.default):
            schema["default"] = field.default
        properties[field.name] = schema
    result: Schema = {"type": "object", "title": cls.__name__, "properties": properties}
    if required:
        result["required"] = required
    result["additionalProperties"] = False
    return result


def _array(item: Any, depth: int) -> Schema:
    schema: Schema = {"type": "array"}
    if items := hint_schema(item, depth + 1):
        schema["items"] = items
    return schema


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _item_hint(hint: Any) -> Any:
    """What one caller sends or gets of a batched function's list hint."""
    if typing.get_origin(hint) in _LISTS and typing.get_args(hint):
        return typing.get_args(hint)[0]
    return Any


def arguments_schema(
    func: Callable[..., Any], *, batched: bool = False, takes_instance: bool = False
) -> Schema:
    """The schema of a call's JSON object of keyword arguments (`takes_instance`: the
    function of a class's method, whose first parameter is the instance)."""
    hints = parameter_hints(func)
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return {"type": "object"}
    if takes_instance:
        parameters = parameters[1:]
    properties: dict[str, Schema] = {}
    required: list[str] = []
    open_ended = False
    for parameter in parameters:
        if parameter.kind is parameter.VAR_KEYWORD:
            open_ended = True
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.POSITIONAL_ONLY):
            continue  # calls pass keyword arguments only
        hint = hints.get(parameter.name, Any)
        schema = hint_schema(_item_hint(hint) if batched else hint)
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        elif _json_value(parameter.default):
            if (
                parameter.default is None
                and schema
                and {"type": "null"} not in schema.get("anyOf", [])
            ):
                schema = {"anyOf": [schema, {"type": "null"}]}  # `n: int = None` takes null
            schema["default"] = parameter.default
        properties[parameter.name] = schema
    result: Schema = {"type": "object", "properties": properties}
    if required:
        result["required"] = required
    if not open_ended:
        result["additionalProperties"] = False
    return result


def result_schema(func: Callable[..., Any], *, batched: bool = False) -> Schema:
    """The schema of one result (of a generator: of one item it yields); FILE_RESULT for
    a file; {} when the return hint says nothing."""
    try:
        hint = typing.get_type_hints(func).get("return", Any)
    except Exception:  # an unresolvable forward reference: say nothing rather than wrong
        return {}
    if batched:
        hint = _item_hint(hint)
    if typing.get_origin(hint) in _ITERATORS:
        args = typing.get_args(hint)
        hint = args[0] if args else Any
    if hint is bytes or hint is File:
        return dict(FILE_RESULT)
    return hint_schema(hint)


def summary_and_description(func: Callable[..., Any]) -> tuple[str, str]:
    """The docstring's first paragraph and the rest, each one line of prose or empty."""
    doc = (inspect.getdoc(func) or "")[:MAX_DOC_CHARS]
    first, _, rest = doc.strip().partition("\n\n")
    return " ".join(first.split()), rest.strip()
