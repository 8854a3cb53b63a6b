"""Names as Python spells them (`round_trip`, `MyModel`) mean the labels deploy made of
them (`round-trip`, `mymodel`): a user who types the function's name finds it."""

from __future__ import annotations

import pytest

from ember.errors import InvalidError
from ember.wire.labels import (
    Route,
    checked_label,
    label_as_deployed,
    meant_label,
    nearest_label,
    route_request,
)


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("audio--round_trip", "audio--round-trip"),
        ("audio--Round_Trip", "audio--round-trip"),
        ("my_app--MyModel_v2", "my-app--mymodel-v2"),
        ("team--my_app--echo_it", "team--my-app--echo-it"),
    ],
)
def test_python_spellings_mean_the_deployed_label(typed: str, meant: str) -> None:
    assert label_as_deployed(typed) == meant
    assert meant_label(typed) == meant


def test_a_label_is_itself() -> None:
    assert meant_label("audio--round-trip") == "audio--round-trip"


@pytest.mark.parametrize("typed", ["audio", "a b--c", "audio--_", "main--app--echo"])
def test_what_means_no_label_is_refused_as_before(typed: str) -> None:
    assert label_as_deployed(typed) is None
    with pytest.raises(InvalidError, match="labels look like APP--ENDPOINT"):
        meant_label(typed)


def test_the_refusal_names_the_label_meant() -> None:
    with pytest.raises(
        InvalidError, match=r"names are lower case, with hyphens: 'audio--round-trip'"
    ):
        checked_label("audio--round_trip")


def test_a_url_with_the_python_spelling_routes_to_the_label() -> None:
    route = route_request("127.0.0.1:8443", "/audio--round_trip/run", None)
    assert route == Route("audio--round-trip", "run", True, "/audio--round_trip")
    assert route_request("127.0.0.1:8443", "/audio--a b/", None) is None


def test_the_nearest_label_is_named_only_when_close() -> None:
    labels = ["audio--round-trip", "audio--transcribe", "hello--greet"]
    assert nearest_label("audio--round-trips", labels) == "audio--round-trip"
    assert nearest_label("audio--roundtrip", labels) == "audio--round-trip"
    assert nearest_label("hello--greets", labels) == "hello--greet"
    assert nearest_label("shop--checkout", labels) is None
    assert nearest_label("audio--x", []) is None
