"""W3C Trace Context: a call continues its caller's trace or starts one, with a span of
its own; code in a replica reads the trace and passes it on to the calls it makes."""

from __future__ import annotations

import json

from ember import cancellation
from ember.calling.call_bodies import call_body
from ember.calling.tracing import continue_trace, current_trace_id

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_valid_traceparent_is_continued_with_a_new_span() -> None:
    context = continue_trace(f"00-{TRACE}-00f067aa0ba902b7-00")
    assert (context.trace_id, context.parent_span, context.flags) == (
        TRACE,
        "00f067aa0ba902b7",
        "00",
    )
    assert len(context.span_id) == 16 and context.span_id != "00f067aa0ba902b7"
    assert context.traceparent == f"00-{TRACE}-{context.span_id}-00"


def test_a_missing_or_invalid_traceparent_starts_a_new_trace() -> None:
    for value in (None, "", "junk", f"01-{TRACE}-00f067aa0ba902b7-01",
                  f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{TRACE}-{'0' * 16}-01"):  # fmt: skip
        context = continue_trace(value)
        assert context.parent_span is None and len(context.trace_id) == 32
        assert context.trace_id != TRACE


def test_calls_made_for_an_input_carry_its_traceparent() -> None:
    traceparent = f"00-{TRACE}-1111111111111111-01"
    flag = cancellation.InputFlag("c-parent", trace=traceparent)
    seen: list[object] = []

    def work() -> None:
        seen.append(current_trace_id())
        seen.append(call_body({"x": 1})["headers"])

    cancellation.bound(flag, work)()
    assert seen[0] == TRACE
    headers = seen[1]
    assert isinstance(headers, dict) and headers["traceparent"] == traceparent
    assert headers["X-Ember-Parent-Call-Id"] == "c-parent"
    assert "traceparent" not in call_body({})["headers"]  # outside an input
    assert json.loads(call_body({"x": 1})["content"]) == {"x": 1}
