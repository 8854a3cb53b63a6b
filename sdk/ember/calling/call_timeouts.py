"""A call's own time limit: `X-Ember-Timeout: SECONDS` (`call(_timeout=2.5)`).

From its arrival, waiting and running both count; past it, the platform takes the call
off the queue or stops it in its replica, freeing the slot, and answers 504
`deadline_exceeded`. Retries of a lost replica do not extend it. It can only shorten
what the endpoint's own `timeout` allows."""

from __future__ import annotations

import math

from ember.errors import InvalidError

CALL_TIMEOUT_HEADER = "X-Ember-Timeout"
MAX_CALL_TIMEOUT = 24 * 3600.0
# What the SDK's HTTP request waits beyond the call's limit: time for the platform's
# own 504 to arrive, rather than a transport timeout of the client's.
ANSWER_GRACE_S = 10.0


def check_call_timeout(seconds: float) -> float:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 < seconds <= MAX_CALL_TIMEOUT
    ):
        raise InvalidError(
            f"a call's timeout is a number of seconds above 0 and at most {MAX_CALL_TIMEOUT:g}"
            f", not {seconds!r}"
        )
    return float(seconds)


def parse_call_timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidError(f"{text!r} is not a number of seconds") from None
    return check_call_timeout(seconds)


def timeout_headers(seconds: float | None) -> dict[str, str]:
    if seconds is None:
        return {}
    return {CALL_TIMEOUT_HEADER: str(check_call_timeout(seconds))}


def request_seconds(seconds: float | None) -> float | None:
    """How long the HTTP request of a call limited to `seconds` may take."""
    return None if seconds is None else seconds + ANSWER_GRACE_S
