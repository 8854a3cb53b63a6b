"""`ember run`'s words: the endpoint named after the file (`app.py::job`, Modal's form),
as its own word, or left out when the file has one; a new user's `::` form or a missing
name no longer ends in "unrecognized arguments" or "the following arguments are required"."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.cli.apps.run_once import chosen_endpoint, run_target
from ember.cli.main import build_parser
from ember.errors import InvalidError


def words(*argv: str) -> tuple[Path, str | None, str, str]:
    args = build_parser().parse_args(["run", *argv])
    return run_target(args.file, args.endpoint, args.arguments)


def test_the_endpoint_may_follow_the_file_as_modal_writes_it() -> None:
    assert words("app.py::job", '{"rows": 3}') == (Path("app.py"), "job", "", '{"rows": 3}')
    assert words("app.py::Model.predict") == (Path("app.py"), "Model", "predict", "{}")
    assert words("app.py::round_trip", "@args.json")[1] == "round_trip"
    assert words("app.py", "job", '{"rows": 3}') == (Path("app.py"), "job", "", '{"rows": 3}')
    assert words("app.py", "model/predict")[1:3] == ("model", "predict")


def test_the_endpoint_may_be_left_out() -> None:
    assert words("app.py") == (Path("app.py"), None, "", "{}")
    assert words("app.py", '{"rows": 3}') == (Path("app.py"), None, "", '{"rows": 3}')
    assert words("app.py", "-")[1:] == (None, "", "-")
    assert words("app.py::", "{}")[1] is None


def test_words_that_cannot_be_meant_are_refused() -> None:
    with pytest.raises(InvalidError, match="names the endpoint already"):
        words("app.py::job", "other", "{}")
    with pytest.raises(InvalidError, match="endpoint name 'no!' is not allowed"):
        words("app.py", "no!")


def test_the_file_s_only_endpoint_is_chosen_else_the_names_are_listed() -> None:
    assert chosen_endpoint(Path("app.py"), None, {"job"}) == "job"
    assert chosen_endpoint(Path("app.py"), "round_trip", {"round-trip", "x"}) == "round-trip"
    with pytest.raises(InvalidError) as two:
        chosen_endpoint(Path("app.py"), None, {"job", "chunks"})
    assert str(two.value) == (
        "app.py has 2 endpoints (chunks, job): name one, as in `ember run app.py::chunks`"
    )
    with pytest.raises(InvalidError, match=r"has no endpoint 'nope' \(it has: job\)"):
        chosen_endpoint(Path("app.py"), "nope", {"job"})
