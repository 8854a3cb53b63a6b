"""Command-line keyword arguments given as JSON."""

from __future__ import annotations

import pytest

from ember.cli.common import json_object
from ember.errors import InvalidError


def test_a_json_object_is_returned() -> None:
    assert json_object('{"text": "hi", "n": 2}', "the arguments", "{}") == {"text": "hi", "n": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [("{oops", "--args must be JSON"), ("[1, 2]", "--args must be a JSON object, e.g. '{}'")],
)
def test_anything_else_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(InvalidError) as info:
        json_object(text, "--args", "{}")
    assert str(info.value).startswith(message)
