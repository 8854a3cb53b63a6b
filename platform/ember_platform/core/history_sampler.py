"""Takes a `Reading` of every endpoint every few seconds, from what `/metrics` already
counts (the registry's counters and histograms) and the live state (queues, replicas,
the workers' GPU samples), into a `MetricsHistory`."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client.metrics import MetricWrapperBase

from ember.wire.labels import make_label
from ember_platform.observability.history import SAMPLE_SECONDS, MetricsHistory, Reading
from ember_platform.observability.metrics import PlatformMetrics

if TYPE_CHECKING:
    from ember_platform.core.cluster import Cluster
    from ember_platform.runtime.cluster_model import Worker

log = logging.getLogger("ember.history")

# A request "failed" when its answer was an error; 499 (its caller left) is no failure of
# the endpoint's.
CALLER_LEFT = "499"


def _is_error(status: str) -> bool:
    return status.isdigit() and int(status) >= 400 and status != CALLER_LEFT


def _totals(metric: MetricWrapperBase, suffix: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of a metric's samples named `<name><suffix>`."""
    rows = []
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix:
                rows.append((sample.labels, sample.value))
    return rows


def _label(labels: dict[str, str]) -> str:
    return make_label(labels.get("app", ""), labels.get("endpoint", ""))


def read_metrics(metrics: PlatformMetrics) -> dict[str, Reading]:
    """The registry's running totals per endpoint label, summed over any other labels
    (a `kind` or `status`), so that a label added later changes nothing here."""
    readings: dict[str, Reading] = defaultdict(Reading)
    for labels, value in _totals(metrics.requests, "_total"):
        reading = readings[_label(labels)]
        reading.requests += value
        if _is_error(labels.get("status", "")):
            reading.errors += value
    for name, histogram in (
        ("e2e", metrics.e2e_latency),
        ("ttft", metrics.ttft),
        ("itl", metrics.itl),
    ):
        for labels, value in _totals(histogram, "_bucket"):
            buckets = readings[_label(labels)].latencies.setdefault(name, {})
            bound = float(labels["le"])  # "+Inf" reads as inf
            buckets[bound] = buckets.get(bound, 0.0) + value  # type: ignore[index]
    for labels, value in _totals(metrics.replica_starts, "_total"):
        starts = readings[_label(labels)].starts
        starts[labels["kind"]] = starts.get(labels["kind"], 0.0) + value
    for labels, value in _totals(metrics.replica_start_seconds, "_sum"):
        if labels.get("phase") == "total":
            took = readings[_label(labels)].start_seconds
            took[labels["kind"]] = took.get(labels["kind"], 0.0) + value
    return readings


def read_cluster(cluster: Cluster) -> dict[str, Reading]:
    """Every live endpoint's readings: the registry's totals with its queue, its replicas
    by state and the power of the GPUs they hold."""
    totals = read_metrics(cluster.metrics)
    readings: dict[str, Reading] = {}
    for runtime in cluster.state.runtimes():  # a canary counts with its endpoint
        reading = readings.setdefault(runtime.label, totals.get(runtime.label, Reading()))
        reading.queued += len(runtime.pending)
        for replica in runtime.replicas.values():
            reading.running += len(replica.inflight)
    watts = gpu_watts(cluster.workers.values())
    for replica in cluster.replicas.values():
        of_endpoint = readings.get(replica.endpoint.label)
        if of_endpoint is None:
            continue
        state = str(replica.state)
        of_endpoint.replicas[state] = of_endpoint.replicas.get(state, 0) + 1
        if replica.gpu is not None and replica.worker_id in watts:
            held = watts[replica.worker_id] * replica.gpu[1]
            of_endpoint.gpu_watts = (of_endpoint.gpu_watts or 0.0) + held
    return readings


def gpu_watts(workers: Iterable[Worker]) -> dict[str, float]:
    """Each worker's mean power per GPU, by worker id, where its GPUs report power: the
    control plane does not know which of a node's GPUs a replica holds, so a replica is
    counted its share of the node's draw."""
    watts = {}
    for worker in workers:
        powers = [
            float(s["power_watts"])
            for s in worker.gpu_samples
            if isinstance(s.get("power_watts"), int | float)
            and not isinstance(s.get("power_watts"), bool)
        ]
        if powers and all(math.isfinite(p) for p in powers):
            watts[worker.id] = sum(powers) / len(powers)
    return watts


# Seconds between readings, for tests and demos that cannot wait for the default's points.
INTERVAL_ENV = "EMBER_HISTORY_SAMPLE_SECONDS"


def sample_seconds(environ: Mapping[str, str]) -> float:
    """The interval `environ` asks for (0.1 s to a minute), else the default."""
    try:
        asked = float(environ.get(INTERVAL_ENV, ""))
    except ValueError:
        return SAMPLE_SECONDS
    return min(max(asked, 0.1), 60.0) if math.isfinite(asked) else SAMPLE_SECONDS


async def sample_forever(cluster: Cluster, history: MetricsHistory) -> None:
    """Take a reading every `history.interval` seconds until cancelled."""
    interval = history.interval
    while True:
        try:
            history.record(time.time(), read_cluster(cluster))
        except Exception:  # a bad sample must not end the history
            log.exception("could not sample the endpoints' metrics for the dashboard")
        await asyncio.sleep(interval)
