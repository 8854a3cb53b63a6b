"""The dashboard's history: bounded rings, rates, quantiles from histogram buckets."""

from __future__ import annotations

import math
from typing import TypeVar

import pytest
from prometheus_client.metrics import MetricWrapperBase

from ember_platform.core.history_sampler import gpu_watts, read_metrics, sample_seconds
from ember_platform.observability.history import (
    MetricsHistory,
    Reading,
    Ring,
    quantile,
)
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.cluster_model import Worker

INF = math.inf
M = TypeVar("M", bound=MetricWrapperBase)


def test_a_ring_keeps_its_newest_items_only() -> None:
    ring = Ring(3)
    for n in range(5):
        ring.append(float(n))
    assert list(ring) == [2.0, 3.0, 4.0] and len(ring) == 3
    assert ring.last(2) == [3.0, 4.0] and ring.last(0) == []
    ring.append(None)  # a gap
    assert list(ring) == [3.0, 4.0, None] and ring.last(5) == [3.0, 4.0, None]
    half = Ring(4)
    half.append(1.5)
    assert list(half) == [1.5] and len(half) == 1
    with pytest.raises(ValueError):
        Ring(0)


def test_quantiles_interpolate_inside_buckets() -> None:
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, INF: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.7, buckets) == pytest.approx(0.3)  # 20 of the 40 in (0.1, 0.5]
    assert quantile(0.99, buckets) == pytest.approx(0.95)
    assert quantile(0.5, {0.1: 0.0, INF: 0.0}) is None  # nothing observed
    assert quantile(0.99, {1.0: 1.0, INF: 2.0}) == 1.0  # past the last bound
    assert quantile(0.5, {}) is None


def test_a_history_holds_one_hour_and_its_rates() -> None:
    history = MetricsHistory(window=60, interval=5)  # 12 points
    assert history.capacity == 12
    for n in range(20):  # 100 s of 2 requests/s, one error every 5 s
        reading = Reading(requests=10.0 * n, errors=float(n), queued=n % 3)
        reading.replicas = {"ready": 1}
        reading.latencies = {"e2e": {0.1: 9.0 * n, 1.0: 10.0 * n, INF: 10.0 * n}}
        history.record(1000.0 + 5 * n, {"a--b": reading})
    data = history.of("a--b")
    assert data is not None
    times, series = data["t"], data["series"]
    assert isinstance(times, list) and isinstance(series, dict)
    assert len(times) == 12 and times[0] == 1040.0 and times[-1] == 1095.0
    assert set(series["requests_per_s"]) == {2.0}
    assert set(series["errors_per_s"]) == {0.2}
    assert series["e2e_p50"][-1] == pytest.approx(0.1 * 5 / 9, abs=1e-6)  # 90 % of them under 0.1 s
    assert series["queued"][-3:] == [2.0, 0.0, 1.0]
    assert series["replicas_ready"][-1] == 1.0 and series["replicas_starting"][-1] == 0.0
    assert series["ttft_p50"][-1] is None  # no streams
    assert series["gpu_watts"][-1] is None
    later = history.of("a--b", after=1085.0)
    assert later is not None and later["t"] == [1090.0, 1095.0]
    assert history.of("x--y") is None
    # An endpoint read no more for a whole window is forgotten.
    history.record(1095.0 + 61, {})
    assert history.labels() == []


def test_starts_by_kind_and_their_mean_duration_per_interval() -> None:
    history = MetricsHistory(window=60, interval=5)
    history.record(1000.0, {"a--b": Reading()})
    started = Reading(starts={"cold": 2.0, "restore": 1.0})
    started.start_seconds = {"cold": 6.0, "restore": 0.25}
    history.record(1005.0, {"a--b": started})
    history.record(1010.0, {"a--b": started})  # nothing new
    data = history.of("a--b")
    assert data is not None
    series = data["series"]
    assert isinstance(series, dict)
    assert series["starts_cold"] == [0.0, 2.0, 0.0]
    assert series["start_cold_seconds"] == [None, 3.0, None]
    assert series["start_restore_seconds"] == [None, 0.25, None]
    # Starts before an endpoint's first reading count in its first point.
    history.record(1015.0, {"c--d": started})
    first = history.of("c--d")
    assert first is not None and isinstance(first["series"], dict)
    assert first["series"]["starts_cold"] == [2.0]
    assert first["series"]["start_restore_seconds"] == [0.25]
    assert first["series"]["requests_per_s"] == [None]  # a rate needs two readings


def test_a_series_first_seen_late_lines_up_with_the_times() -> None:
    history = MetricsHistory(window=60, interval=5)
    history.record(1000.0, {"a--b": Reading()})
    history.record(1005.0, {"a--b": Reading(gpu_watts=150.0, starts={"lazy": 1.0})})
    data = history.of("a--b")
    assert data is not None and isinstance(data["series"], dict)
    assert data["series"]["gpu_watts"] == [None, 150.0]
    assert data["series"]["starts_lazy"] == [None, 1.0]


def test_a_counter_that_restarts_counts_from_zero() -> None:
    history = MetricsHistory(window=60, interval=5)
    history.record(1000.0, {"a--b": Reading(requests=100.0)})
    history.record(1005.0, {"a--b": Reading(requests=10.0)})
    data = history.of("a--b")
    assert data is not None and isinstance(data["series"], dict)
    assert data["series"]["requests_per_s"] == [None, 2.0]


def labelled(metric: M, **values: str) -> M:
    """The child of `metric` with these label values; a label not named (one added
    later, such as a call's kind) gets "sync"."""
    names: tuple[str, ...] = metric._labelnames
    return metric.labels(**{name: values.get(name, "sync") for name in names})


def test_readings_come_from_the_registry_summed_over_other_labels() -> None:
    metrics = PlatformMetrics()
    for status, count in (("200", 3), ("500", 2), ("499", 1)):  # 499: the caller left
        labelled(metrics.requests, app="shop", endpoint="buy", status=status).inc(count)
    labelled(metrics.requests, app="shop", endpoint="buy", status="200", kind="stream").inc()
    labelled(metrics.e2e_latency, app="shop", endpoint="buy").observe(0.2)
    metrics.replica_started("shop", "buy", {"kind": "restore", "total_seconds": 0.5})
    metrics.replica_started("team--shop", "buy", {"kind": "cold", "total_seconds": 4.0})
    readings = read_metrics(metrics)
    buy = readings["shop--buy"]
    assert buy.requests == 7 and buy.errors == 2
    assert buy.latencies["e2e"][INF] == 1 and buy.latencies["e2e"][0.1] == 0
    assert buy.starts == {"restore": 1.0} and buy.start_seconds == {"restore": 0.5}
    assert readings["team--shop--buy"].starts == {"cold": 1.0}


def test_the_sampling_interval_may_be_set_within_bounds() -> None:
    assert sample_seconds({}) == 5.0
    assert sample_seconds({"EMBER_HISTORY_SAMPLE_SECONDS": "0.5"}) == 0.5
    assert sample_seconds({"EMBER_HISTORY_SAMPLE_SECONDS": "0"}) == 0.1
    assert sample_seconds({"EMBER_HISTORY_SAMPLE_SECONDS": "nan"}) == 5.0
    assert sample_seconds({"EMBER_HISTORY_SAMPLE_SECONDS": "soon"}) == 5.0


def test_gpu_power_is_each_nodes_mean_per_gpu_where_reported() -> None:
    powered = Worker("w1", "gpu-node", 16, 65536, {"H100": 2})
    powered.gpu_samples = [{"index": 0, "power_watts": 300.0}, {"index": 1, "power_watts": 100}]
    silent = Worker("w2", "old-node", 16, 65536, {"T4": 1})
    silent.gpu_samples = [{"index": 0, "power_watts": None}]
    cpu_only = Worker("w3", "cpu-node", 8, 16384, {})
    assert gpu_watts([powered, silent, cpu_only]) == {"w1": 200.0}
