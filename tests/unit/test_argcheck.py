"""Arguments against type hints: what JSON can carry is checked, the rest is left alone."""

from __future__ import annotations

from typing import Any, Literal, Optional

import pytest

from ember.declarations.argcheck import ArgumentTypeError, check_arguments, parameter_hints


def fn(
    n: int,
    x: float,
    text: str,
    flag: bool,
    ids: list[int],
    table: dict[str, float],
    pair: tuple[int, str],
    many: tuple[int, ...],
    mode: Literal["fast", "exact"],
    maybe: int | None,
    old_style: Optional[str],  # noqa: UP045
    anything: Any,
    thing: Thing,
    limit: int = None,  # type: ignore[assignment]  # noqa: RUF013  (null: its default)
) -> dict:
    return {}


class Thing:
    pass


GOOD: dict[str, Any] = {
    "n": 3,
    "x": 2,  # an int is a fine float
    "text": "hi",
    "flag": False,
    "ids": [1, 2],
    "table": {"a": 1.5},
    "pair": [1, "a"],
    "many": [1, 2, 3],
    "mode": "fast",
    "maybe": None,
    "old_style": "s",
    "anything": {"deep": [None]},
    "thing": "not checked: a class JSON cannot carry",
    "limit": None,
}
DEFAULTS = {"limit": None}


def test_arguments_that_fit_pass() -> None:
    check_arguments(parameter_hints(fn), DEFAULTS, GOOD)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("n", "3", "n: expected int, got str '3'"),
        ("n", True, "n: expected int, got bool True"),
        ("n", 1.5, "n: expected int, got float 1.5"),
        ("x", "1", "x: expected float, got str '1'"),
        ("text", 5, "text: expected str, got int 5"),
        ("flag", 1, "flag: expected bool, got int 1"),
        ("ids", [1, "2"], "ids[1]: expected int, got str '2'"),
        ("ids", "1,2", "ids: expected a list, got str '1,2'"),
        ("table", {"a": "b"}, "table['a']: expected float, got str 'b'"),
        ("table", [], "table: expected an object, got list []"),
        ("pair", [1], "pair: expected 2 items, got 1"),
        ("pair", [1, 2], "pair[1]: expected str, got int 2"),
        ("many", [1, "x"], "many[1]: expected int, got str 'x'"),
        ("mode", "slow", "mode: expected one of ['fast', 'exact'], got str 'slow'"),
        ("maybe", "1", "maybe: expected int | None, got str '1'"),
        ("old_style", 3, "old_style: expected Optional[str], got int 3"),
        ("n", None, "n: expected int, got null"),
    ],
)
def test_arguments_that_do_not_fit_are_named(name: str, value: Any, message: str) -> None:
    with pytest.raises(ArgumentTypeError) as caught:
        check_arguments(parameter_hints(fn), DEFAULTS, {**GOOD, name: value})
    assert str(caught.value) == message


def test_unresolvable_hints_check_nothing() -> None:
    def broken(a: Missing) -> None:  # type: ignore[name-defined]  # noqa: F821
        pass

    assert parameter_hints(broken) == {}
    check_arguments(parameter_hints(broken), {}, {"a": object()})
