"""The control plane's Prometheus metrics: what a replica start records."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ember_platform.observability.metrics import PlatformMetrics


def samples(metrics: PlatformMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_start_counts_once_and_observes_each_phase() -> None:
    metrics = PlatformMetrics()
    start = {"kind": "restore", "total_seconds": 0.3, "restore_seconds": 0.07, "note": "x"}
    metrics.replica_started("demo", "lm", start)
    metrics.replica_started("demo", "lm", {"kind": "cold", "total_seconds": 7.0})
    metrics.start_phase("demo", "lm", "restore", "memory_in", 0.5)
    found = samples(metrics)
    base = (("app", "demo"), ("endpoint", "lm"))
    assert found[("ember:replica_starts_total", (*base, ("kind", "restore")))] == 1
    assert found[("ember:replica_starts_total", (*base, ("kind", "cold")))] == 1

    def phase(kind: str, name: str) -> tuple[tuple[str, str], ...]:
        return (*base, ("kind", kind), ("phase", name))

    assert found[("ember:replica_start_seconds_count", phase("restore", "restore"))] == 1
    assert found[("ember:replica_start_seconds_sum", phase("restore", "memory_in"))] == 0.5
    assert found[("ember:replica_start_seconds_sum", phase("cold", "total"))] == 7.0
    # Only `<phase>_seconds` entries are phases.
    assert not any(dict(labels).get("phase") == "note" for _, labels in found)


def test_registries_are_separate() -> None:
    first, second = PlatformMetrics(), PlatformMetrics()
    first.snapshot_event("demo", "lm", "dumped")
    assert "ember:snapshot_events_total{" in first.exposition().decode()
    assert "ember:snapshot_events_total{" not in second.exposition().decode()


def test_gpu_gauges_follow_the_latest_samples() -> None:
    metrics = PlatformMetrics()
    sample = {
        "index": 0,
        "name": "NVIDIA H200",
        "power_watts": 312.5,
        "temperature_celsius": 51.0,
        "utilization_ratio": 0.87,
        "memory_used_bytes": 2**30,
        "memory_total_bytes": 141 * 2**30,
        "bogus": "ignored",
    }
    metrics.set_gpus([("node-1", sample)])
    text = metrics.exposition().decode()
    labels = 'gpu="0",model="NVIDIA H200",worker="node-1"'
    assert f"ember:gpu_power_watts{{{labels}}} 312.5" in text
    assert f"ember:gpu_utilization_ratio{{{labels}}} 0.87" in text
    metrics.set_gpus([])  # the worker left
    assert "ember:gpu_power_watts{" not in metrics.exposition().decode()


def test_no_nvml_means_no_samples_and_no_error() -> None:
    import importlib.util

    from ember_worker.gpus.telemetry import GpuTelemetry

    telemetry = GpuTelemetry()
    if importlib.util.find_spec("pynvml") is None:
        assert telemetry.sample() == []
        assert telemetry.sample() == []  # asked again: still nothing, no new attempt
    else:
        assert isinstance(telemetry.sample(), list)


def test_weights_reads_count_what_each_heartbeat_adds() -> None:
    metrics = PlatformMetrics()
    base = (("app", "demo"), ("endpoint", "lm"))

    def found(name: str, tier: str | None = None) -> float:
        labels = (*base, ("tier", tier)) if tier else base
        return samples(metrics).get((name, tuple(sorted(labels))), 0.0)

    first = {"chunks": 10, "memory_hits": 2, "disk_hits": 3, "origin_requests": 6}
    metrics.weights_read("r-1", "demo", "lm", {**first, "origin_bytes": 500})
    # The same totals again add nothing; a second replica adds its own.
    metrics.weights_read("r-1", "demo", "lm", {**first, "origin_bytes": 500})
    metrics.weights_read("r-2", "demo", "lm", {"chunks": 4, "memory_hits": 4})
    assert found("ember:weights_chunks_total", "memory") == 6
    assert found("ember:weights_chunks_total", "disk") == 3
    assert found("ember:weights_chunks_total", "origin") == 5
    assert found("ember:weights_origin_bytes_total") == 500
    assert found("ember:weights_origin_requests_total") == 6
    # Totals that went down started again (a restored process): counted from zero.
    metrics.weights_read("r-1", "demo", "lm", {"chunks": 1, "disk_hits": 1, "bad": True})
    assert found("ember:weights_chunks_total", "disk") == 4
    metrics.forget_replica("r-1")
    metrics.weights_read("r-1", "demo", "lm", {"chunks": 1, "disk_hits": 1})
    assert found("ember:weights_chunks_total", "disk") == 5
