"""What each endpoint's replicas held over a period: replica-seconds, and the CPUs, memory
and GPUs they reserved for that long, with their starts and inputs. A serverless
platform's bill is made of these; `ember usage` shows them.

Replicas are recorded when they end (`ReplicaUsage` in the store); the live ones are
counted up to now. Each replica's time is clipped to the period asked about."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ember_platform.observability.prices import Prices
from ember_platform.observability.token_usage import Tokens
from ember_platform.storage.records import ReplicaUsage, TokenUsage

# Ended replicas' records kept, for `ember usage --since` up to this far back.
USAGE_RETENTION_SECONDS = 31 * 86_400


@dataclass
class EndpointUsage:
    app: str
    endpoint: str
    replicas: int = 0
    replica_seconds: float = 0.0
    cpu_seconds: float = 0.0
    gib_seconds: float = 0.0
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # by GPU type
    starts: dict[str, int] = field(default_factory=dict)  # by kind, within the period
    inputs: int = 0
    # LLM endpoints: tokens their answers said, by traffic ("online", "batch").
    tokens: dict[str, Tokens] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "app": self.app,
            "endpoint": self.endpoint,
            "replicas": self.replicas,
            "replica_seconds": round(self.replica_seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "gib_seconds": round(self.gib_seconds, 3),
            "gpu_seconds": {k: round(v, 3) for k, v in sorted(self.gpu_seconds.items())},
            "starts": dict(sorted(self.starts.items())),
            "inputs": self.inputs,
            "tokens": {
                traffic: {"input": t.input, "output": t.output, "requests": t.requests}
                for traffic, t in sorted(self.tokens.items())
            },
        }

    def priced(self, prices: Prices) -> dict[str, object]:
        """Its cost at `prices`, and for LLM endpoints what a million output tokens cost
        and how many million tokens (in and out) a unit buys, per traffic: the replicas'
        cost shared out by output tokens."""
        cost = prices.of_usage(self.cpu_seconds, self.gib_seconds, self.gpu_seconds)
        output = sum(t.output for t in self.tokens.values())
        per_traffic = {}
        for traffic, t in sorted(self.tokens.items()):
            share = cost * t.output / output if output else 0.0
            per_traffic[traffic] = {
                "cost": share,
                "cost_per_million_output_tokens": share / t.output * 1e6 if t.output else None,
                "million_tokens_per_unit": (t.input + t.output) / 1e6 / share if share else None,
            }
        return {"cost": cost, "by_traffic": per_traffic}


def summarize(
    records: Iterable[ReplicaUsage],
    since: float,
    until: float,
    tokens: Iterable[TokenUsage] = (),
) -> list[EndpointUsage]:
    """Per endpoint, sorted by app and endpoint: what its replicas held within
    [since, until], and the tokens its answers said (rows of the store's token_usage).
    Inputs count in full for every replica that overlaps the period."""
    by_endpoint: dict[tuple[str, str], EndpointUsage] = {}
    for said in tokens:
        key = (said.app, said.endpoint)
        usage = by_endpoint.setdefault(key, EndpointUsage(said.app, said.endpoint))
        usage.tokens[said.traffic] = Tokens(said.input_tokens, said.output_tokens, said.requests)
    for record in records:
        seconds = min(record.ended_at, until) - max(record.started_at, since)
        if seconds < 0:
            continue
        key = (record.app, record.endpoint)
        usage = by_endpoint.setdefault(key, EndpointUsage(record.app, record.endpoint))
        usage.replicas += 1
        usage.replica_seconds += seconds
        usage.cpu_seconds += record.cpu * seconds
        usage.gib_seconds += record.memory_mib / 1024 * seconds
        if record.gpu_type and record.gpu_count:
            gpu = record.gpu_type
            usage.gpu_seconds[gpu] = usage.gpu_seconds.get(gpu, 0.0) + record.gpu_count * seconds
        if record.start_kind and record.started_at >= since:
            usage.starts[record.start_kind] = usage.starts.get(record.start_kind, 0) + 1
        usage.inputs += record.inputs
    return [by_endpoint[key] for key in sorted(by_endpoint)]
