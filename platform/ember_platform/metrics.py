"""The control plane's Prometheus metrics, served at `GET /metrics`.

Names follow vLLM's style (`ember:` prefix, base units, `_total` counters), labelled by
app and endpoint. Each control plane owns its registry: nothing is registered globally.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

# Replica starts span a 10 ms restore to a 10-minute first compile.
START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class PlatformMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.replica_starts = Counter(
            "ember:replica_starts",
            "Replicas that became ready, by how they started (cold or restore).",
            ["app", "endpoint", "kind"],
            registry=self.registry,
        )
        self.replica_start_seconds = Histogram(
            "ember:replica_start_seconds",
            "Duration of each phase of a replica's start: total (placement to ready), "
            "boot, fetch, restore, enter, first_input, memory_in (lazy restores).",
            ["app", "endpoint", "kind", "phase"],
            buckets=START_BUCKETS,
            registry=self.registry,
        )
        self.snapshot_events = Counter(
            "ember:snapshot_events",
            "Snapshot lifecycle events: dumped, published, take_failed, restore_failed.",
            ["app", "endpoint", "event"],
            registry=self.registry,
        )

    def replica_started(self, app: str, endpoint: str, start: dict[str, object]) -> None:
        """A replica is ready: `start` is its start report (kind, `<phase>_seconds`)."""
        kind = str(start.get("kind", "cold"))
        self.replica_starts.labels(app, endpoint, kind).inc()
        for key, value in start.items():
            if key.endswith("_seconds") and isinstance(value, int | float):
                self.start_phase(app, endpoint, kind, key.removesuffix("_seconds"), value)

    def start_phase(self, app: str, endpoint: str, kind: str, phase: str, seconds: float) -> None:
        """One phase known later than `ready` (the first input, a lazy restore's memory)."""
        self.replica_start_seconds.labels(app, endpoint, kind, phase).observe(seconds)

    def snapshot_event(self, app: str, endpoint: str, event: str) -> None:
        self.snapshot_events.labels(app, endpoint, event).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
