"""OTLP spans made from the gateway's request stats, and the exporter's options."""

from __future__ import annotations

import pytest

from ember.calling.tracing import TraceContext
from ember_platform.calls.spans import (
    export_body,
    parse_headers,
    request_span,
    traces_url,
)
from ember_platform.observability.request_stats import RequestStats

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _stats(status: int, *, flags: str = "01", stream: bool = False) -> RequestStats:
    stats = RequestStats("req-1", "app", "echo", "__call__", stream, arrived=100.0)
    stats.trace = TraceContext(TRACE, "00f067aa0ba902b7", "a3ce929d0e0e4736", flags)
    if stream:
        stats.note_event(b'{"n": 0}', now=100.2)
        stats.note_event(b'{"n": 1}', now=100.3)
    stats.finish(status, "r-1", 0.05)
    stats.ended = 100.5
    return stats


def test_a_span_has_the_trace_its_parent_timings_and_attributes() -> None:
    span = request_span(_stats(200), now=1_000.0)
    assert span is not None
    assert (span["traceId"], span["spanId"], span["parentSpanId"]) == (
        TRACE,
        "00f067aa0ba902b7",
        "a3ce929d0e0e4736",
    )
    assert span["startTimeUnixNano"] == str(999_500_000_000)
    assert span["endTimeUnixNano"] == str(1_000_000_000_000)
    assert span["events"] == [{"timeUnixNano": str(999_550_000_000), "name": "dispatched"}]
    attributes = {a["key"]: a["value"] for a in span["attributes"]}
    assert attributes["http.response.status_code"] == {"intValue": "200"}
    assert attributes["ember.replica"] == {"stringValue": "r-1"}
    assert span["status"] == {"code": 0} and span["name"] == "app--echo __call__"


def test_server_failures_are_errors_and_caller_mistakes_are_not() -> None:
    assert request_span(_stats(503), now=0.0)["status"] == {"code": 2}  # type: ignore[index]
    assert request_span(_stats(404), now=0.0)["status"] == {"code": 0}  # type: ignore[index]


def test_a_stream_span_marks_its_first_event() -> None:
    span = request_span(_stats(200, stream=True), now=1_000.0)
    assert span is not None
    assert {"timeUnixNano": str(999_700_000_000), "name": "first_event"} in span["events"]


def test_unsampled_traces_are_not_exported() -> None:
    assert request_span(_stats(200, flags="00")) is None


def test_the_export_body_names_the_service() -> None:
    body = export_body([{"spanId": "x"}])
    (resource,) = body["resourceSpans"]
    assert resource["resource"]["attributes"][0] == {
        "key": "service.name",
        "value": {"stringValue": "ember"},
    }
    assert resource["scopeSpans"][0]["spans"] == [{"spanId": "x"}]


def test_urls_and_headers_follow_otel_conventions() -> None:
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/v1/traces") == "https://c/v1/traces"
    assert parse_headers("api-key=abc, x-team = ml ,") == {"api-key": "abc", "x-team": "ml"}
    assert parse_headers("") == {}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_headers("novalue")
