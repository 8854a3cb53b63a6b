"""Arguments and results that are Pydantic models, dataclasses or enums.

A parameter hinted with a Pydantic model (anything with `model_validate`) gets the model
built from the call's JSON object, validated by Pydantic; one hinted with a dataclass
gets the dataclass, its fields checked against their hints (`ember.declarations.argcheck`). Either
may be inside `T | None` or `list[T]`. A value that does not fit is a 400 naming the
field. An `enum.Enum` parameter gets the member whose value the JSON gives (a 400 names
the values it takes). Results, stream events and SDK arguments that are models,
dataclasses or enum members go as their JSON form. Pydantic is never imported here:
only the user's classes use it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Sequence
from typing import Any

from ember.declarations.argcheck import ArgumentTypeError, describe, problem

_UNION_TYPES = (typing.Union, types.UnionType)
_LISTS = (list, Sequence, typing.Sequence)
MAX_DEPTH = 12


def is_model(hint: Any) -> bool:
    """A Pydantic (v2) model class."""
    return isinstance(hint, type) and callable(getattr(hint, "model_validate", None))


def is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def is_enum_type(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _enum_member(value: Any, cls: type[enum.Enum], where: str) -> enum.Enum:
    for member in cls:
        if member.value == value and type(member.value) is type(value):
            return member
    values = [member.value for member in cls]
    raise ArgumentTypeError(
        f"{where}: expected one of {values!r} ({cls.__name__}), got {describe(value)}"
    )


def has_structured(hint: Any, depth: int = 0) -> bool:
    """Whether a value of `hint` holds a model or dataclass to build."""
    if depth > MAX_DEPTH:
        return False
    if is_model(hint) or is_dataclass_type(hint) or is_enum_type(hint):
        return True
    return any(has_structured(arg, depth + 1) for arg in typing.get_args(hint))


def convert(value: Any, hint: Any, where: str, depth: int = 0) -> Any:
    """`value` (decoded JSON) as `hint` asks: models and dataclasses built, inside
    unions and lists too; ArgumentTypeError says which field does not fit."""
    if depth > MAX_DEPTH:
        return value
    if is_model(hint):
        return _model(value, hint, where)
    if is_dataclass_type(hint):
        return _dataclass(value, hint, where, depth)
    if is_enum_type(hint):
        return _enum_member(value, hint, where)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in _UNION_TYPES:
        if value is None and type(None) in args:
            return None
        failures = []
        for option in args:
            if option is type(None):
                continue
            try:
                return convert(value, option, where, depth + 1)
            except ArgumentTypeError as exc:
                failures.append(str(exc))
        raise ArgumentTypeError(failures[0] if failures else f"{where}: no option fits")
    if origin in _LISTS and args and isinstance(value, list):
        return [convert(item, args[0], f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    found = problem(value, hint, where)
    if found:
        raise ArgumentTypeError(found)
    return value


def _model(value: Any, model: Any, where: str) -> Any:
    try:
        return model.model_validate(value)
    except Exception as exc:  # Pydantic's ValidationError, whose text names the fields
        errors = getattr(exc, "errors", None)
        if callable(errors):
            parts = []
            for error in errors()[:3]:
                field = ".".join(str(p) for p in error.get("loc", ()))
                parts.append(f"{where}.{field}: {error.get('msg')}" if field else error.get("msg"))
            raise ArgumentTypeError("; ".join(str(p) for p in parts)) from None
        raise ArgumentTypeError(f"{where}: {exc}") from None


def _dataclass(value: Any, cls: Any, where: str, depth: int) -> Any:
    if not isinstance(value, dict):
        raise ArgumentTypeError(
            f"{where}: expected an object ({cls.__name__}), got {describe(value)}"
        )
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable forward reference: fields unchecked
        hints = {}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ArgumentTypeError(f"{where}: {cls.__name__} has no field {unknown[0]!r}")
    built = {}
    for name, field in fields.items():
        if name not in value:
            if (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ):
                raise ArgumentTypeError(f"{where}.{name}: missing (a field of {cls.__name__})")
            continue
        hint = hints.get(name, Any)
        built[name] = convert(value[name], hint, f"{where}.{name}", depth + 1)
    return cls(**built)


def to_json(value: Any) -> Any:
    """For `json.dumps(default=...)`: a model or dataclass instance as its JSON form;
    TypeError for anything else, as json.dumps expects."""
    dump = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, type):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
