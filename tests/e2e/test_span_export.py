"""Requests' spans reach an OpenTelemetry collector over OTLP/HTTP, with the trace tree
of calls that call others, and are held while the collector is away."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import EMBER, free_port, running_platform, wait_for
from otlp_collector import start_collector


def _attributes(span: dict[str, Any]) -> dict[str, Any]:
    return {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


def test_spans_reach_the_collector_with_their_tree_and_wait_out_its_absence(
    tmp_path: Path, apps_dir: Path
) -> None:
    port = free_port()  # the collector comes up only later
    extra = ("--otlp-endpoint", f"http://127.0.0.1:{port}", "--otlp-header", "x-api-key=k1")
    with running_platform(tmp_path / "cp", extra=extra) as platform:
        platform.deploy(apps_dir / "composed.py", "traced")
        trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        with platform.client() as client:
            early = client.post("/traced--square/", json={"x": 3})
            assert early.status_code == 200  # serving does not wait on the collector
            answer = client.post(
                "/traced--sum-of-squares/",
                json={"n": 3},
                headers={"traceparent": f"00-{trace}-{caller_span}-01"},
            )
            assert answer.json() == {"total": 5, "counted": [0, 1, 2]}
        collector = start_collector(port)
        try:
            # Held while the collector was away: the early call and the fan-out's five.
            spans = list(wait_for(lambda: len(collector.spans) >= 6 and collector.spans, 20))
            # A spawned call's span covers it from its acceptance to its end.
            spawner = "b7ad6b7169203331"
            with platform.client() as client:
                accepted = client.post(
                    "/traced--square/",
                    json={"x": 4},
                    headers={
                        "Prefer": "respond-async",
                        "traceparent": f"00-{trace}-{spawner}-01",
                    },
                )
                call_id = accepted.json()["call_id"]
                result = client.get(f"/v1/calls/{call_id}", params={"wait": 30})
                assert result.json() == 16
            spawned = wait_for(
                lambda: [s for s in collector.spans if _attributes(s).get("ember.spawned")], 20
            )
        finally:
            collector.stop()
        (call,) = spawned
        assert (call["traceId"], call["parentSpanId"]) == (trace, spawner)
        assert _attributes(call)["ember.call_id"] == call_id
        assert _attributes(call)["http.response.status_code"] == "200"
        assert all(h.get("x-api-key") == "k1" for h in collector.headers)
        assert early.headers["x-ember-trace-id"] in {s["traceId"] for s in spans}
        tree = [s for s in spans if s["traceId"] == trace]
        (root,) = [s for s in tree if _attributes(s)["ember.endpoint"] == "sum-of-squares"]
        assert root["parentSpanId"] == caller_span and root["kind"] == 2
        children = [s for s in tree if s is not root]
        assert sorted(_attributes(s)["ember.endpoint"] for s in children) == [
            "count",
            *["square"] * 3,
        ]
        assert all(s["parentSpanId"] == root["spanId"] for s in children)
        assert len({s["spanId"] for s in tree}) == 5
        for span in tree:
            attributes = _attributes(span)
            assert attributes["http.response.status_code"] == "200"
            assert attributes["ember.app"] == "traced" and attributes["ember.replica"]
            assert int(span["startTimeUnixNano"]) < int(span["endTimeUnixNano"])
            assert span["status"] == {"code": 0}
            assert "dispatched" in [e["name"] for e in span["events"]]
        (stream,) = [s for s in children if _attributes(s)["ember.endpoint"] == "count"]
        assert "first_event" in [e["name"] for e in stream["events"]]
        assert _attributes(stream)["ember.events"] == "3"
        # A child's span lies within its parent's.
        assert all(int(s["startTimeUnixNano"]) >= int(root["startTimeUnixNano"]) for s in children)


@pytest.mark.parametrize(
    ("options", "env", "said"),
    [
        (("--otlp-endpoint", "localhost:4318"), {}, "--otlp-endpoint 'localhost:4318' is not"),
        (("--otlp-endpoint", "http://:4318"), {}, "is not an http(s) URL of a collector"),
        ((), {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://c:4317"}, "$OTEL_EXPORTER_OTLP_ENDPOINT"),
        (
            ("--otlp-endpoint", "http://127.0.0.1:4318"),
            {"OTEL_EXPORTER_OTLP_HEADERS": "api-key"},
            "$OTEL_EXPORTER_OTLP_HEADERS: 'api-key' is not KEY=VALUE",
        ),
    ],
)
def test_collector_settings_that_cannot_work_stop_the_start(
    tmp_path: Path, options: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    command = [*EMBER, "server", "--state-dir", str(tmp_path / "state"), "--port", "0"]
    started = subprocess.run(
        [*command, "--no-worker", *options],
        env={**os.environ, "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 1, started.stderr
    assert said in started.stderr
