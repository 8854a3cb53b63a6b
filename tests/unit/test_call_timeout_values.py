"""What a call's own time limit may be, and the header that carries it."""

from __future__ import annotations

import math

import pytest

from ember.calling.call_timeouts import (
    ANSWER_GRACE_S,
    CALL_TIMEOUT_HEADER,
    parse_call_timeout,
    request_seconds,
    timeout_headers,
)
from ember.errors import InvalidError


def test_limits_travel_as_seconds_in_one_header() -> None:
    assert timeout_headers(2.5) == {CALL_TIMEOUT_HEADER: "2.5"}
    assert timeout_headers(None) == {}
    assert parse_call_timeout("0.25") == 0.25 and parse_call_timeout("86400") == 86400.0


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, 86_401, True, "2"])
def test_limits_outside_a_day_or_not_numbers_are_refused(bad: object) -> None:
    with pytest.raises(InvalidError):
        timeout_headers(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "soon", "1e9", "-0.5", "inf"])
def test_header_values_that_are_not_a_limit_are_refused(bad: str) -> None:
    with pytest.raises(InvalidError):
        parse_call_timeout(bad)


def test_the_sdk_waits_past_the_limit_for_the_platform_answer() -> None:
    assert request_seconds(None) is None
    assert request_seconds(3.0) == 3.0 + ANSWER_GRACE_S
