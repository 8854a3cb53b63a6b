"""What the agent says when the control plane refuses its channel's handshake."""

from __future__ import annotations

from ember_worker.agent.control_channel import refusal_reason


def test_the_control_planes_reason_is_said() -> None:
    body = b'{"error": {"type": "forbidden", "message": "it is an invoke token"}}'
    assert refusal_reason(body) == "it is an invoke token"


def test_an_answer_without_a_reason_gets_the_possible_causes() -> None:
    fallback = "it is wrong, revoked or expired, or not a worker token"
    for body in (None, b"", b"<html>403</html>", b"[1]", b'{"error": "no"}', b'{"error": {}}'):
        assert refusal_reason(body) == fallback
