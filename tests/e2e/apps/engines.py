"""Endpoints whose fake engines keep Prometheus metrics of their own (`engine_metrics=`):
one in the replica process's prometheus_client registry, scaled on its gauge of waiting
requests (which a call sets), and one that serves its metrics on a loopback port, as an
engine with a server of its own does."""

import uuid

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

import ember

SERVED_PORT = 47913  # loopback, in the replica's sandbox

WAITING = Gauge(
    "fake_engine:num_requests_waiting", "Requests the fake engine holds waiting.", ["model_name"]
)
SERVED = Counter("fake_engine:requests", "Requests the fake engine took.", ["model_name"])


@ember.endpoint(
    min_replicas=1,  # the gauge's replica stays, whatever the timing of its scrapes
    max_replicas=3,
    scaledown_window=1.0,
    snapshot=False,
    engine_metrics="prometheus",
    scale_on=ember.MetricTarget("fake_engine:num_requests_waiting", per_replica=2.0),
)
def waiting(count: float = 0.0) -> float:
    """The fake engine now holds `count` requests waiting."""
    WAITING.labels("tiny").set(count)
    SERVED.labels("tiny").inc()
    return count


@ember.endpoint(
    max_replicas=1,
    snapshot=False,
    engine_metrics=f"http://127.0.0.1:{SERVED_PORT}/metrics",
)
class Served:
    @ember.enter()
    def start(self) -> None:
        self.registry = CollectorRegistry()
        self.tokens = Counter(
            "fake_server:generation_tokens", "Tokens made.", registry=self.registry
        )
        start_http_server(SERVED_PORT, addr="127.0.0.1", registry=self.registry)

    @ember.method
    def generate(self, tokens: int) -> int:
        self.tokens.inc(tokens)
        return tokens


# A fake chat engine routed by prompt prefix: each replica process says who it is (its
# identity gauge's label) and keeps the vLLM gauge of requests waiting in its own queue,
# which a call sets.
ME = uuid.uuid4().hex
ENGINE_WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting.", ["model_name"])
IDENTITY = Gauge("fake_chat:identity", "This replica process.", ["me"])
IDENTITY.labels(ME).set(1)


@ember.endpoint(
    min_replicas=2,
    max_replicas=2,
    snapshot=False,
    route_by="prefix",
    engine_metrics="prometheus",
)
def chat(messages: list[dict[str, str]], waiting: float = 0.0) -> str:
    """Who answered; its engine now holds `waiting` requests waiting."""
    ENGINE_WAITING.labels("tiny").set(waiting)
    return ME
