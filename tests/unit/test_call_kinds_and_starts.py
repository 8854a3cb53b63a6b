"""Issue 37's metrics a new user missed: spawned calls in `ember:requests_total` and the
latency histograms (a `kind` label: sync, stream, async), user metrics declared without
labels exported at 0 before their first use, and each endpoint's last start kept in the
state store (both backends) so that a restart of the control plane does not forget it."""

from __future__ import annotations

from store_backends import StoreOpener

import ember
from ember import user_metrics
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.request_stats import RequestStats
from ember_platform.storage.records import Deployment


def exported(metrics: PlatformMetrics) -> dict[str, float]:
    lines = metrics.exposition().decode().splitlines()
    return {
        series: float(value)
        for series, _, value in (line.rpartition(" ") for line in lines)
        if not series.startswith("#")
    }


def test_each_kind_of_call_is_counted_and_timed_apart() -> None:
    metrics = PlatformMetrics()
    for streaming in (False, True):
        stats = RequestStats("c-1", "demo", "lm", "generate", streaming)
        stats.finish(200, "r-1", queue_seconds=0.01)
        metrics.request_finished(stats)
    metrics.call_finished("demo", "lm", 200, e2e=3.0, queued=1.0)
    metrics.call_finished("demo", "lm", 500, e2e=0.5, queued=None)
    metrics.request_turned_away("demo", "lm", 429, "async")
    found = exported(metrics)
    base = 'app="demo",endpoint="lm"'
    assert found[f'ember:requests_total{{{base},kind="sync",status="200"}}'] == 1
    assert found[f'ember:requests_total{{{base},kind="stream",status="200"}}'] == 1
    assert found[f'ember:requests_total{{{base},kind="async",status="200"}}'] == 1
    assert found[f'ember:requests_total{{{base},kind="async",status="500"}}'] == 1
    assert found[f'ember:requests_total{{{base},kind="async",status="429"}}'] == 1
    assert found[f'ember:e2e_request_latency_seconds_count{{{base},kind="async"}}'] == 2
    assert found[f'ember:e2e_request_latency_seconds_sum{{{base},kind="async"}}'] == 3.5
    assert found[f'ember:request_queue_time_seconds_count{{{base},kind="async"}}'] == 1
    assert found[f'ember:e2e_request_latency_seconds_count{{{base},kind="sync"}}'] == 1


def test_a_declared_counter_is_exported_at_zero_before_its_first_use() -> None:
    accepted = ember.Counter("t_zero_accepted", "Draft tokens accepted")
    ember.Histogram("t_zero_steps", "Steps", buckets=[0.1, 1.0])
    ember.Counter("t_zero_by_model", "Per model", ["model"])  # label values unknown yet
    rows = {row["name"]: row for row in user_metrics.snapshot()}
    assert rows["t_zero_accepted"]["value"] == 0.0 and rows["t_zero_steps"]["value"] == 0.0
    assert "t_zero_by_model" not in rows
    metrics = PlatformMetrics()
    metrics.user.report("r-1", "llm", "chat", list(rows.values()))
    base = 'app="llm",endpoint="chat"'
    found = exported(metrics)
    assert found[f"ember:user_t_zero_accepted_total{{{base}}}"] == 0.0
    assert found[f"ember:user_t_zero_steps_count{{{base}}}"] == 0.0
    accepted.inc(2)
    rows = {row["name"]: row for row in user_metrics.snapshot()}
    metrics.user.report("r-1", "llm", "chat", list(rows.values()))
    assert exported(metrics)[f"ember:user_t_zero_accepted_total{{{base}}}"] == 2.0


def test_last_starts_are_kept_per_endpoint_until_the_app_stops(open_store: StoreOpener) -> None:
    store = open_store()
    store.put_deployment(Deployment("shop", 1, "sha256:0", {"app": "shop"}, 1.0))
    cold = {"kind": "cold", "total_seconds": 4.2, "boot_seconds": 3.9}
    restore = {"kind": "restore", "total_seconds": 0.31, "lazy": True}
    store.put_endpoint_start("shop--greet", "shop", cold, 10.0)
    store.put_endpoint_start("shop--greet", "shop", restore, 20.0)  # the last one stands
    store.put_endpoint_start("shop--other", "shop", cold, 11.0)
    store.put_endpoint_start("team--x--y", "team--x", cold, 12.0)
    store.close()
    again = open_store()  # a restart
    assert again.endpoint_starts() == {
        "shop--greet": restore,
        "shop--other": cold,
        "team--x--y": cold,
    }
    assert again.delete_app("shop") is True
    assert again.endpoint_starts() == {"team--x--y": cold}
