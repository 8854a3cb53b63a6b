"""`ember replica exec -i`'s WebSocket: a try cut off before the server answered is made
again (nothing ran yet), an HTTP refusal is not, and the last failure says it all."""

from __future__ import annotations

import ssl
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.http11 import Response

from ember.cli.ops.exec_session import OPEN_ATTEMPTS, open_session
from ember.errors import ServerUnreachableError

URL = "https://127.0.0.1:8443"


def tries(*outcomes: Any) -> tuple[Any, list[int], list[float]]:
    """A connect that raises or returns each outcome in turn; calls and sleeps seen."""
    calls: list[int] = []
    pending = list(outcomes)

    def connect_once() -> Any:
        calls.append(1)
        outcome = pending.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return connect_once, calls, []


def test_a_try_cut_off_before_the_answer_is_made_again() -> None:
    connection = object()
    cut = ConnectionClosedError(None, None)
    connect_once, calls, sleeps = tries(ssl.SSLEOFError(8, "EOF occurred"), cut, connection)
    assert open_session(connect_once, URL, sleep=sleeps.append) is connection
    assert len(calls) == 3 and sleeps == [0.25, 0.5]


def test_the_last_failure_is_reported_and_a_refusal_is_not_tried_again() -> None:
    failures = [ConnectionRefusedError(111, "Connection refused")] * OPEN_ATTEMPTS
    connect_once, calls, sleeps = tries(*failures)
    with pytest.raises(
        ServerUnreachableError, match=r"cannot reach https://127\.0\.0\.1:8443: .*refused"
    ):
        open_session(connect_once, URL, sleep=sleeps.append)
    assert len(calls) == OPEN_ATTEMPTS

    refused = InvalidStatus(Response(403, "Forbidden", None, b""))  # type: ignore[arg-type]
    connect_once, calls, sleeps = tries(refused)
    with pytest.raises(InvalidStatus):
        open_session(connect_once, URL, sleep=sleeps.append)
    assert len(calls) == 1 and sleeps == []
