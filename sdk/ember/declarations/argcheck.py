"""Arguments checked against the endpoint's type hints before its code runs, so that a
caller who sends `{"n": "3"}` to `def f(n: int)` gets a 400 that says so, not a 500 from
deep inside the code.

Only what JSON can carry is checked: `int`, `float` (an int will do), `str`, `bool`,
`bytes` (sent as base64), `None`, `list[T]`, `tuple[...]`, `dict[str, T]`, unions
(`T | None`), `Literal[...]` and `Any`. Other hints (classes, protocols, forward
references that do not resolve) are left to the code."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_UNION_TYPES = (typing.Union, types.UnionType)


class ArgumentTypeError(Exception):
    """An argument does not have the type its parameter's hint asks for."""


def describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    kind = "null" if value is None else type(value).__name__
    return f"{kind} {text}" if value is not None else kind


def hint_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def problem(value: Any, hint: Any, where: str) -> str | None:
    """Why `value` (decoded JSON) does not fit `hint`, or None when it does (or when the
    hint is not one this checks)."""
    if hint is Any or hint is typing.Any:
        return None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in _UNION_TYPES:
        if any(problem(value, option, where) is None for option in args):
            return None
        return f"{where}: expected {hint_name(hint)}, got {describe(value)}"
    if origin is typing.Literal:
        if any(value == option and type(value) is type(option) for option in args):
            return None
        return f"{where}: expected one of {list(args)!r}, got {describe(value)}"
    if hint is type(None) or hint is None:
        return None if value is None else f"{where}: expected null, got {describe(value)}"
    if hint is bool:
        return None if isinstance(value, bool) else f"{where}: expected bool, got {describe(value)}"
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return None
        return f"{where}: expected int, got {describe(value)}"
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return None
        return f"{where}: expected float, got {describe(value)}"
    if hint is str:
        return None if isinstance(value, str) else f"{where}: expected str, got {describe(value)}"
    if hint is bytes:  # decoded from base64 before the check (ember.declarations.parameters)
        if isinstance(value, bytes):
            return None
        return f"{where}: expected bytes (a base64 string in JSON), got {describe(value)}"
    container = origin or hint
    if container in (list, Sequence, typing.Sequence, set, frozenset, tuple):
        if not isinstance(value, list):
            return f"{where}: expected a list, got {describe(value)}"
        if container is tuple and args and args[-1] is not Ellipsis:  # tuple[int, str]
            if len(value) != len(args):
                return f"{where}: expected {len(args)} items, got {len(value)}"
            item_hints = list(args)
        else:  # list[int], tuple[int, ...]
            item_hints = [args[0]] * len(value) if args else []
        for index, (item, item_hint) in enumerate(zip(value, item_hints, strict=False)):
            found = problem(item, item_hint, f"{where}[{index}]")
            if found:
                return found
        return None
    if container in (dict, Mapping, typing.Mapping):
        if not isinstance(value, dict):
            return f"{where}: expected an object, got {describe(value)}"
        if len(args) == 2:
            for key, item in value.items():
                found = problem(item, args[1], f"{where}[{key!r}]")
                if found:
                    return found
        return None
    return None  # a hint this does not check: the code's business


def parameter_hints(func: Callable[..., Any]) -> dict[str, Any]:
    """The function's parameter hints, resolved; {} when they cannot be (then nothing is
    checked rather than something wrongly)."""
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # a forward reference to a name the module lacks, and the like
        return {}
    hints.pop("return", None)
    return hints


def check_arguments(
    hints: Mapping[str, Any], defaults: Mapping[str, Any], arguments: Mapping[str, Any]
) -> None:
    """ArgumentTypeError naming the first argument that does not fit its hint. Null is
    accepted where the parameter's default is None (`def f(n: int = None)`)."""
    for name, value in arguments.items():
        hint = hints.get(name)
        if hint is None or (value is None and name in defaults and defaults[name] is None):
            continue
        found = problem(value, hint, name)
        if found:
            raise ArgumentTypeError(found)
