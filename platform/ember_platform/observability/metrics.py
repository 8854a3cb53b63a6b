"""The control plane's Prometheus metrics, served at `GET /metrics`.

Names follow vLLM's style (`ember:` prefix, base units, `_total` counters), labelled by
app and endpoint. Each control plane owns its registry: nothing is registered globally.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from ember_platform.observability.user_metrics import UserMetrics

if TYPE_CHECKING:
    from ember_platform.observability.request_stats import RequestStats

# Replica starts span a 10 ms restore to a 10-minute first compile.
START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Request latencies: from a 1 ms answer to a long generation (vLLM's choice, give or take).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
# Gaps between streamed events (tokens): sub-millisecond to seconds.
GAP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
ENDPOINT_LABELS = ("app", "endpoint")
# Worker GPU telemetry (NVML), as sent in heartbeats: sample field -> help text.
GPU_FIELDS = {
    "power_watts": "GPU power draw in watts.",
    "temperature_celsius": "GPU temperature in degrees Celsius.",
    "utilization_ratio": "Share of the last sample period the GPU was busy (0 to 1).",
    "memory_used_bytes": "GPU memory in use.",
    "memory_total_bytes": "GPU memory in all.",
}

CONTENT_TYPE = CONTENT_TYPE_LATEST

# A call's kind, in the `kind` label of the request metrics: a synchronous call answered
# whole, a synchronous stream, or a spawned call (Prefer: respond-async).
SYNC = "sync"
STREAM = "stream"
ASYNC = "async"


def call_kind(streaming: bool, is_async: bool) -> str:
    return ASYNC if is_async else STREAM if streaming else SYNC


class UsageMetrics:
    """What LLM endpoints' tokens were and what replicas' time cost (`ember usage` says
    the same over a period)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.llm_tokens = Counter(
            "ember:llm_tokens",
            "Tokens LLM endpoints' answers say they read (input) and wrote (output), by "
            "traffic: online (calls) or batch (the Batch API's requests).",
            (*ENDPOINT_LABELS, "kind", "traffic"),
            registry=registry,
        )
        self.replica_cost = Counter(
            "ember:replica_cost",
            "What the endpoint's replicas' time cost at the prices ember server --price set.",
            ENDPOINT_LABELS,
            registry=registry,
        )

    def tokens_used(self, app: str, endpoint: str, traffic: str, tokens: tuple[int, int]) -> None:
        self.llm_tokens.labels(app, endpoint, "input", traffic).inc(tokens[0])
        self.llm_tokens.labels(app, endpoint, "output", traffic).inc(tokens[1])


class GpuHealthMetrics:
    """Each worker's GPUs' health as their NVML watches say (`ember node ls` too)."""

    STATES = ("healthy", "degraded", "failed", "unknown")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.health = Gauge(
            "ember:gpu_health",
            "1 for the state each GPU is in (healthy, degraded, failed, unknown), 0 for the "
            "others; fenced is 1 while it takes no replicas (failed, until uncordoned).",
            ("worker", "gpu", "model", "state"),
            registry=registry,
        )
        self.fenced = Gauge(
            "ember:gpu_fenced",
            "1 while the GPU takes no new replicas for its health, until `ember node "
            "uncordon NODE --gpu N`.",
            ("worker", "gpu", "model"),
            registry=registry,
        )

    def set(self, rows: Iterable[tuple[str, int, str, str, bool]]) -> None:
        """(worker name, GPU index, model, state, fenced) of every GPU now."""
        self.health.clear()
        self.fenced.clear()
        for worker, index, model, state, fenced in rows:
            for each in self.STATES:
                self.health.labels(worker, str(index), model, each).set(int(each == state))
            self.fenced.labels(worker, str(index), model).set(int(fenced))


class PlatformMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # A synchronous request's three series, by (app, endpoint, status, kind): none of
        # them is ever removed, so the children stay valid.
        self._finished_series: dict[tuple[str, str, int | None, str], tuple[Any, Any, Any]] = {}
        self.replica_starts = Counter(
            "ember:replica_starts",
            "Replicas that became ready, by how they started (cold or restore).",
            ["app", "endpoint", "kind"],
            registry=self.registry,
        )
        self.replica_start_seconds = Histogram(
            "ember:replica_start_seconds",
            "Duration of each phase of a replica's start: total (placement to ready), "
            "boot, fetch, restore, gpu_restore (the part of restore that puts device memory "
            "back), weights_check (restores of images that read weights), enter, "
            "first_input, memory_in (lazy restores).",
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
        self.replicas_unhealthy = Counter(
            "ember:replicas_unhealthy",
            "Replicas replaced because their @ember.health_check failed.",
            ["app", "endpoint"],
            registry=self.registry,
        )
        self.webhook_deliveries = Counter(
            "ember:webhook_deliveries",
            "Attempts to deliver spawned calls' webhooks, by outcome: delivered, retried "
            "(a failed attempt with more to come) or failed (the last one failed).",
            ["app", "endpoint", "outcome"],
            registry=self.registry,
        )
        self.affinity_inputs = Counter(
            "ember:affinity_inputs",
            "Inputs with an affinity key (X-Ember-Affinity), by where they ran: home (the "
            "key's replica) or elsewhere (its home was full).",
            ["app", "endpoint", "placement"],
            registry=self.registry,
        )
        self.prefix_routed = Counter(
            "ember:prefix_routed",
            "Inputs of endpoints that route by prefix (route_by='prefix'), by how they were "
            "placed: cached (on the replica with the longest cached prefix of the prompt), "
            "busy (that replica was busy: on the least loaded) or new (no ready replica "
            "had served a block of it).",
            ["app", "endpoint", "placement"],
            registry=self.registry,
        )
        self.replica_memory = Gauge(
            "ember:replica_memory_bytes",
            "Memory a replica's processes use (proportional set size), as its worker last "
            "measured it; compare with the endpoint's memory= request.",
            ["app", "endpoint", "replica"],
            registry=self.registry,
        )

        self.replica_cpu_throttled = Gauge(
            "ember:replica_cpu_throttled_seconds",
            "Seconds a replica has waited for CPU time so far, held back by its endpoint's "
            "cpu_limit= (it only grows while the replica lives); as its worker last read it.",
            ["app", "endpoint", "replica"],
            registry=self.registry,
        )

        self.user = UserMetrics()  # the endpoints' own (ember.Counter, ember.Gauge)
        self.registry.register(self.user)
        self._requests(self.registry)
        self._gpus(self.registry)
        self._weights(self.registry)

    def _requests(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, ENDPOINT_LABELS, buckets=buckets, registry=registry)

        def by_kind(name: str, text: str) -> Histogram:
            labels = (*ENDPOINT_LABELS, "kind")
            return Histogram(name, text, labels, buckets=LATENCY_BUCKETS, registry=registry)

        self.requests = Counter(
            "ember:requests",
            "Calls that ended, by HTTP status (499: the caller left) and kind (sync, "
            "stream, or async: spawned), and calls refused before they ran (429: a full "
            "queue).",
            [*ENDPOINT_LABELS, "status", "kind"],
            registry=registry,
        )
        self.log_lines_dropped = Counter(
            "ember:log_lines_dropped",
            "Lines of replicas' output their nodes dropped instead of keeping in the app's "
            "log: printed past the replica's log limit (ember worker --log-rate, log_rate=), "
            "or while the node's buffer of lines was full.",
            list(ENDPOINT_LABELS),
            registry=registry,
        )
        self.scheduled_runs = Counter(
            "ember:scheduled_runs",
            "Runs of scheduled endpoints, started or skipped (the previous one had not "
            "started, or the queue was full).",
            [*ENDPOINT_LABELS, "outcome"],
            registry=registry,
        )
        self.queue_time = by_kind(
            "ember:request_queue_time_seconds",
            "From a call's arrival until a replica took it, by kind (sync, stream, async).",
        )
        self.e2e_latency = by_kind(
            "ember:e2e_request_latency_seconds",
            "From a call's arrival to the end of its answer (a spawned call's: to its "
            "result), by kind (sync, stream, async).",
        )
        self.version_requests = Counter(
            "ember:version_requests",
            "Synchronous requests of endpoints that have a canary, by the side that took "
            "them (role: canary or serving) and HTTP status: a canary's two sides compared.",
            [*ENDPOINT_LABELS, "role", "status"],
            registry=registry,
        )
        self.version_latency = Histogram(
            "ember:version_e2e_request_latency_seconds",
            "End-to-end latency of requests of endpoints that have a canary, by role.",
            [*ENDPOINT_LABELS, "role"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.ttft = histogram(
            "ember:time_to_first_token_seconds",
            "Streams: from a request's arrival to its first event.",
            LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "ember:inter_token_latency_seconds",
            "Streams: the gap between consecutive events.",
            GAP_BUCKETS,
        )
        self.tpot = histogram(
            "ember:time_per_output_token_seconds",
            "Streams: (last event - first event) / (events - 1), per request.",
            GAP_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "ember:prompt_tokens",
            "Prompt token ids seen in request arguments (prompt_ids, input_ids, ...).",
            ENDPOINT_LABELS,
            registry=registry,
        )
        self.generation_tokens = Counter(
            "ember:generation_tokens",
            "Token ids seen in streamed events (token_id, token_ids).",
            ENDPOINT_LABELS,
            registry=registry,
        )
        self.usage = UsageMetrics(registry)
        self.gpu_health = GpuHealthMetrics(registry)
        self.waiting = Gauge(
            "ember:num_requests_waiting",
            "Inputs queued, not yet on a replica.",
            ENDPOINT_LABELS,
            registry=registry,
        )
        self.running = Gauge(
            "ember:num_requests_running",
            "Inputs running on replicas.",
            ENDPOINT_LABELS,
            registry=registry,
        )
        self.held_bytes = Gauge(
            "ember:held_bytes",
            "Bytes the control plane holds now, by workspace: of calls' bodies (kind "
            "bodies), and of their results and stream events not yet taken (kind answers); "
            "each bounded by --workspace-held-mb.",
            ["workspace", "kind"],
            registry=registry,
        )
        self.workspace_refusals = Counter(
            "ember:workspace_refusals",
            "Calls refused with 429 as their workspace was at a limit (max_queued, "
            "max_running, rate), by workspace and limit.",
            ["workspace", "limit"],
            registry=registry,
        )
        self.node_replicas = Gauge(
            "ember:node_replicas",
            "Replicas on each worker node (starting, ready, draining or stopping).",
            ["node"],
            registry=registry,
        )
        self.node_draining = Gauge(
            "ember:node_draining",
            "1 for a worker node that takes no new replicas (`ember node drain`, or its "
            "worker was asked to stop), else 0.",
            ["node"],
            registry=registry,
        )

    def scheduled_run(self, app: str, endpoint: str, outcome: str) -> None:
        self.scheduled_runs.labels(app, endpoint, outcome).inc()

    def log_lines_dropped_by(self, app: str, endpoint: str, lines: int) -> None:
        self.log_lines_dropped.labels(app, endpoint).inc(lines)

    def request_turned_away(self, app: str, endpoint: str, status: int, kind: str) -> None:
        self.requests.labels(app, endpoint, str(status), kind).inc()

    def call_finished(
        self, app: str, endpoint: str, status: int, e2e: float, queued: float | None
    ) -> None:
        """A spawned call ended: counted beside the synchronous ones, as kind async."""
        self.requests.labels(app, endpoint, str(status), ASYNC).inc()
        self.e2e_latency.labels(app, endpoint, ASYNC).observe(max(e2e, 0.0))
        if queued is not None:
            self.queue_time.labels(app, endpoint, ASYNC).observe(max(queued, 0.0))

    def request_finished(self, stats: RequestStats) -> None:
        labels = (stats.app, stats.endpoint)
        kind = call_kind(stats.streaming, is_async=False)
        key = (stats.app, stats.endpoint, stats.status, kind)
        series = self._finished_series.get(key)
        if series is None:  # labels() takes a lock and builds its key on every call
            series = self._finished_series[key] = (
                self.requests.labels(*labels, str(stats.status), kind),
                self.e2e_latency.labels(*labels, kind),
                self.queue_time.labels(*labels, kind),
            )
        requests, e2e_latency, queue_time = series
        requests.inc()
        e2e_latency.observe(stats.e2e_seconds)
        if stats.queue_seconds is not None:
            queue_time.observe(stats.queue_seconds)
        if stats.ttft_seconds is not None:
            self.ttft.labels(*labels).observe(stats.ttft_seconds)
        if stats.gaps:
            gaps = self.itl.labels(*labels)
            for gap in stats.gaps:
                gaps.observe(gap)
        if stats.tpot_seconds is not None:
            self.tpot.labels(*labels).observe(stats.tpot_seconds)
        if stats.prompt_ids:
            self.prompt_tokens.labels(*labels).inc(len(stats.prompt_ids))
        if stats.output_ids:
            self.generation_tokens.labels(*labels).inc(len(stats.output_ids))

    def version_request_finished(self, stats: RequestStats, role: str) -> None:
        """A request of an endpoint with a canary, as the `role` side took it."""
        self.version_requests.labels(stats.app, stats.endpoint, role, str(stats.status)).inc()
        self.version_latency.labels(stats.app, stats.endpoint, role).observe(stats.e2e_seconds)

    def set_load(self, rows: Iterable[tuple[str, str, int, int]]) -> None:
        """(app, endpoint, waiting, running) of every endpoint now: set at each scrape, so
        removed endpoints disappear."""
        self.waiting.clear()
        self.running.clear()
        for app, endpoint, waiting, running in rows:
            self.waiting.labels(app, endpoint).set(waiting)
            self.running.labels(app, endpoint).set(running)

    def set_held(self, rows: Iterable[tuple[str, str, int]]) -> None:
        """(workspace, kind, bytes) held now: set at each scrape."""
        self.held_bytes.clear()
        for workspace, kind, size in rows:
            self.held_bytes.labels(workspace, kind).set(size)

    def workspace_refused(self, workspace: str, limit: str) -> None:
        self.workspace_refusals.labels(workspace, limit).inc()

    def set_nodes(self, rows: Iterable[tuple[str, int, bool]]) -> None:
        """(node, replicas, draining) of every connected worker now."""
        self.node_replicas.clear()
        self.node_draining.clear()
        for node, replicas, draining in rows:
            self.node_replicas.labels(node).set(replicas)
            self.node_draining.labels(node).set(1 if draining else 0)

    def _gpus(self, registry: CollectorRegistry) -> None:
        labels = ("worker", "gpu", "model")
        self.gpu_gauges = {
            field: Gauge(f"ember:gpu_{field}", text, labels, registry=registry)
            for field, text in GPU_FIELDS.items()
        }

    def set_gpus(self, samples: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """(worker name, NVML sample) of every GPU now, from the workers' heartbeats."""
        for gauge in self.gpu_gauges.values():
            gauge.clear()
        for worker, sample in samples:
            labels = (worker, str(sample.get("index", "")), str(sample.get("name", "")))
            for field, gauge in self.gpu_gauges.items():
                value = sample.get(field)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    gauge.labels(*labels).set(value)

    def set_replica_memory(self, rows: Iterable[tuple[str, str, str, int]]) -> None:
        """(app, endpoint, replica, bytes) of every live replica measured so far."""
        self.replica_memory.clear()
        for app, endpoint, replica, used in rows:
            self.replica_memory.labels(app, endpoint, replica).set(used)

    def set_replica_cpu_throttled(self, rows: Iterable[tuple[str, str, str, float]]) -> None:
        """(app, endpoint, replica, seconds) of every live replica with a cpu_limit=."""
        self.replica_cpu_throttled.clear()
        for app, endpoint, replica, waited in rows:
            self.replica_cpu_throttled.labels(app, endpoint, replica).set(waited)

    def _weights(self, registry: CollectorRegistry) -> None:
        self.weights_chunks = Counter(
            "ember:weights_chunks",
            "Chunk lookups of weights readers in replicas, by the tier that served them: "
            "memory (the process or the page cache), disk (the node's cache), origin.",
            ["app", "endpoint", "tier"],
            registry=registry,
        )
        self.weights_origin_bytes = Counter(
            "ember:weights_origin_bytes",
            "Bytes replicas fetched from weights origins (S3, HTTP, files).",
            ["app", "endpoint"],
            registry=registry,
        )
        self.weights_origin_requests = Counter(
            "ember:weights_origin_requests",
            "Range requests replicas sent to weights origins, retries included.",
            ["app", "endpoint"],
            registry=registry,
        )
        # Each replica's last running totals, so a heartbeat adds only what is new.
        self._weights_seen: dict[str, dict[str, int]] = {}

    def weights_read(
        self, replica: str, app: str, endpoint: str, totals: dict[str, object]
    ) -> None:
        """A replica's running totals of weights reads (`weights/totals.py`)."""
        counts = {
            name: value
            for name, value in totals.items()
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
        }
        before = self._weights_seen.get(replica, {})
        self._weights_seen[replica] = counts

        def new(name: str) -> int:
            # Totals only grow; a smaller one is a reset (a restore): count it from zero.
            now, then = counts.get(name, 0), before.get(name, 0)
            return now - then if now >= then else now

        memory, disk = new("memory_hits"), new("disk_hits")
        origin = max(new("chunks") - memory - disk, 0)
        for tier, amount in (("memory", memory), ("disk", disk), ("origin", origin)):
            if amount:
                self.weights_chunks.labels(app, endpoint, tier).inc(amount)
        for counter, name in (
            (self.weights_origin_bytes, "origin_bytes"),
            (self.weights_origin_requests, "origin_requests"),
        ):
            if amount := new(name):
                counter.labels(app, endpoint).inc(amount)

    def forget_replica(self, replica: str) -> None:
        self._weights_seen.pop(replica, None)
        self.user.forget_replica(replica)

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

    def webhook_delivery(self, app: str, endpoint: str, outcome: str) -> None:
        self.webhook_deliveries.labels(app, endpoint, outcome).inc()

    def replica_unhealthy(self, app: str, endpoint: str) -> None:
        self.replicas_unhealthy.labels(app, endpoint).inc()

    def affinity_routed(self, app: str, endpoint: str, home: bool) -> None:
        self.affinity_inputs.labels(app, endpoint, "home" if home else "elsewhere").inc()

    def prefix_routed_to(self, app: str, endpoint: str, placement: str) -> None:
        self.prefix_routed.labels(app, endpoint, placement).inc()

    def snapshot_event(self, app: str, endpoint: str, event: str) -> None:
        self.snapshot_events.labels(app, endpoint, event).inc()

    def exposition(self) -> bytes:
        return with_workspaces(generate_latest(self.registry))


# An app's label holds its key inside the platform (`workspace--app` outside main); a
# scrape shows the workspace and the app's own name apart. main's series keep the labels
# they had before workspaces (no `workspace` label, which PromQL reads as ""): dashboards
# of a one-workspace platform go on working.
_WORKSPACE_APP_LABEL = re.compile(rb'(?<=[{,])app="([a-z0-9-]+?)--([a-z0-9-]+)"')


def with_workspaces(exposition: bytes) -> bytes:
    """Every series of another workspace's app gets its `workspace` label."""
    return _WORKSPACE_APP_LABEL.sub(rb'workspace="\1",app="\2"', exposition)
