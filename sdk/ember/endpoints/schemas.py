"""JSON Schemas of a method's arguments and result, read from its type hints at deploy
time (`EndpointDefinition.spec`), for the OpenAPI document the platform serves of each
endpoint.

The hints translated are those `ember.declarations.argcheck` checks (what JSON can
carry), enums (the members' values), Pydantic models (their own schemas) and
dataclasses; any other hint is a schema that allows any value, as the replica does not
check it either. A parameter's default goes into its schema when it is a JSON value.

Each dataclass and model is defined once, in the schema's `$defs` under its class's
name, and referred to as `{"$ref": "#/$defs/NAME"}`: a class that holds itself is a
reference, and the schema (which the manifest stores) grows with the number of classes.
The platform moves the definitions into the document's `components.schemas`."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from ember.declarations.argcheck import parameter_hints
from ember.declarations.structured import is_dataclass_type, is_model
from ember.files import File

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
DEFS_PREFIX = "#/$defs/"
# What OpenAPI allows in a components.schemas name (and so needs no escaping in a $ref).
DEFINITION_NAME = re.compile(r"[A-Za-z0-9._-]+\Z")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

# What a result that is a file (bytes or ember.File) is, in a schema.
FILE_RESULT: Schema = {"type": "string", "format": "binary"}


def hint_schema(hint: Any) -> Schema:
    """The JSON Schema of values that fit `hint` ({}: any value), standing alone: the
    classes it names are in its `$defs`."""
    schemas = _Schemas()
    return schemas.standalone(schemas.of(hint))


class _Schemas:
    """Schemas of hints in which each dataclass and model is defined once, in
    `definitions` under its name, and referred to by `$ref` wherever it appears. So a
    class that holds itself is a reference, and the schema grows with the number of
    classes, not with how many ways there are down the tree of their fields."""

    def __init__(self) -> None:
        self.definitions: dict[str, Schema] = {}
        self._names: dict[type, str] = {}

    def standalone(self, schema: Schema) -> Schema:
        """`schema` with the definitions it may refer to, for a document of its own."""
        if not schema or not self.definitions:
            return schema
        return {**schema, "$defs": dict(self.definitions)}

    def of(self, hint: Any, depth: int = 0) -> Schema:
        if depth > MAX_DEPTH or hint is Any or hint is typing.Any:
            return {}
        if hint is None:
            hint = type(None)
        if hint in _SCALARS:
            return dict(_SCALARS[hint])
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin in _UNION_TYPES:
            options = [self.of(option, depth + 1) for option in args]
            return {} if {} in options else {"anyOf": options}
        if origin is typing.Literal:
            return {"enum": [v for v in args if _json_scalar(v)]}
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema(hint)
        if is_model(hint):
            return self._model(hint)
        if is_dataclass_type(hint):
            return self._dataclass(hint)
        container = origin or hint
        if container is tuple:
            if args and args[-1] is not Ellipsis:  # tuple[int, str]
                items = [self.of(item, depth + 1) for item in args]
                return {
                    "type": "array",
                    "prefixItems": items,
                    "minItems": len(items),
                    "maxItems": len(items),
                }
            return self._array(args[0] if args else Any, depth)
        if container in _LISTS:
            return self._array(args[0] if args else Any, depth)
        if container in _MAPPINGS:
            schema: Schema = {"type": "object"}
            if len(args) == 2 and (value_schema := self.of(args[1], depth + 1)):
                schema["additionalProperties"] = value_schema
            return schema
        return {}

    def _array(self, item: Any, depth: int) -> Schema:
        schema: Schema = {"type": "array"}
        if items := self.of(item, depth + 1):
            schema["items"] = items
        return schema

    def _claim(self, wanted: str) -> str:
        return claim_name(self.definitions, wanted)

    def _dataclass(self, cls: type) -> Schema:
        name = self._names.get(cls)
        if name is None:
            # Named before its fields are read: a field of its own type refers to it.
            name = self._names[cls] = self._claim(cls.__name__)
            self.definitions[name] = self._dataclass_fields(cls)
        return _ref(name)

    def _dataclass_fields(self, cls: Any) -> Schema:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an unresolvable forward reference: fields of any value
            hints = {}
        properties: dict[str, Schema] = {}
        required: list[str] = []
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            schema = self.of(hints.get(field.name, Any), 1)
            if (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ):
                required.append(field.name)
            elif _json_value(field.default):
                schema["default"] = field.default
            properties[field.name] = schema
        result: Schema = {"type": "object", "title": cls.__name__, "properties": properties}
        if required:
            result["required"] = required
        result["additionalProperties"] = False
        return result

    def _model(self, model: type) -> Schema:
        """A Pydantic model's own JSON Schema, its `$defs` merged into ours (renamed
        where a name is taken); {} if the model cannot give one."""
        name = self._names.get(model)
        if name is not None:
            return _ref(name)
        try:
            schema = model.model_json_schema()  # type: ignore[attr-defined]
        except Exception:  # a model whose schema Pydantic cannot make (arbitrary types)
            return {}
        renamed = merge_definitions(self.definitions, schema.pop("$defs", {}), DEFS_PREFIX)
        top = pointed(schema, renamed, DEFS_PREFIX)
        reference = top.get("$ref")
        if set(top) == {"$ref"} and isinstance(reference, str):  # a model that holds itself
            self._names[model] = reference.removeprefix(DEFS_PREFIX)
            return top
        name = self._names[model] = self._claim(model.__name__)
        self.definitions[name] = top
        return _ref(name)


def _ref(name: str) -> Schema:
    return {"$ref": DEFS_PREFIX + name}


def claim_name(definitions: dict[str, Any], wanted: str) -> str:
    """A name like `wanted` that `definitions` does not hold (a second class of one name
    gets `Name2`), held from now on by an empty schema until its own is put there."""
    base = _NAME_UNSAFE.sub("_", wanted) or "Schema"
    name, number = base, 1
    while name in definitions:
        number += 1
        name = f"{base}{number}"
    definitions[name] = {}
    return name


def merge_definitions(
    into: dict[str, Any], definitions: Mapping[str, Any], prefix: str
) -> dict[str, str]:
    """Put `definitions` (schemas whose references are `#/$defs/NAME`) into `into`, where
    they are referred to as `prefix + NAME`; returns each one's name there. They keep
    their names, so that one that `into` holds already is not repeated, unless a name
    holds something else: then each whose name is taken gets a new one."""
    names = {name: name for name in definitions}
    placed = {name: pointed(schema, names, prefix) for name, schema in definitions.items()}
    if any(
        not DEFINITION_NAME.match(name) or into.get(name, schema) != schema
        for name, schema in placed.items()
    ):
        names = {name: claim_name(into, name) for name in definitions}
        placed = {
            names[name]: pointed(schema, names, prefix) for name, schema in definitions.items()
        }
    into.update(placed)
    return names


def pointed(node: Any, names: Mapping[str, str], prefix: str) -> Any:
    """A copy of `node` whose `#/$defs/NAME` references are `prefix + names[NAME]`; one to
    a name not there becomes a schema of any value."""
    if isinstance(node, list):
        return [pointed(item, names, prefix) for item in node]
    if not isinstance(node, dict):
        return node
    result = {key: pointed(value, names, prefix) for key, value in node.items()}
    reference = node.get("$ref")
    if isinstance(reference, str) and reference.startswith(DEFS_PREFIX):
        target = names.get(reference.removeprefix(DEFS_PREFIX))
        if target is None:
            del result["$ref"]
        else:
            result["$ref"] = prefix + target
    return result


def _enum_schema(cls: type[enum.Enum]) -> Schema:
    """The members' values ({} when one of them is not a JSON scalar)."""
    values = [member.value for member in cls]
    if not all(_json_scalar(value) for value in values):
        return {}
    return {"title": cls.__name__, "enum": values}


def _json_scalar(value: Any) -> bool:
    return value is None or (isinstance(value, str | int | float | bool) and _json_value(value))


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
    schemas = _Schemas()  # one set of definitions for all the parameters
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
        schema = schemas.of(_item_hint(hint) if batched else hint)
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
    return schemas.standalone(result)


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
