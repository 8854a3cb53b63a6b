"""Placement: which worker node runs a new replica. Pure functions over capacities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Demand:
    cpu: float
    memory: int  # MiB
    gpu_type: str | None
    gpu_count: int
    bundle_digest: str


@dataclass(frozen=True)
class NodeCapacity:
    worker_id: str
    cpu: float
    memory: int
    gpus: dict[str, int]  # type -> count on the node
    cpu_used: float = 0.0
    memory_used: int = 0
    gpus_used: dict[str, int] = field(default_factory=dict)
    bundles: frozenset[str] = frozenset()  # bundle digests already on the node

    def fits(self, demand: Demand) -> bool:
        if self.cpu - self.cpu_used < demand.cpu - 1e-9:
            return False
        if self.memory - self.memory_used < demand.memory:
            return False
        if demand.gpu_type:
            free = self.gpus.get(demand.gpu_type, 0) - self.gpus_used.get(demand.gpu_type, 0)
            return free >= demand.gpu_count
        return True

    def could_ever_fit(self, demand: Demand) -> bool:
        empty = NodeCapacity(self.worker_id, self.cpu, self.memory, self.gpus)
        return empty.fits(demand)


def place(demand: Demand, nodes: Sequence[NodeCapacity]) -> str | None:
    """The worker to start a replica on, or None if every node is full right now.

    Prefers a node that already holds the bundle (no download), then the node with the
    most free CPU, so replicas spread out.
    """
    candidates = [n for n in nodes if n.fits(demand)]
    if not candidates:
        return None
    best = max(
        candidates,
        key=lambda n: (demand.bundle_digest in n.bundles, n.cpu - n.cpu_used, n.worker_id),
    )
    return best.worker_id


def unservable_reason(demand: Demand, nodes: Sequence[NodeCapacity]) -> str | None:
    """Why no registered node could ever run this replica, or None if one could."""
    if any(n.could_ever_fit(demand) for n in nodes):
        return None
    if not nodes:
        return "no worker nodes are registered; start one with `ember worker --server URL`"
    kind = ""
    if demand.gpu_type:
        have = sorted({g for n in nodes for g in n.gpus})
        nodes = [n for n in nodes if n.gpus.get(demand.gpu_type, 0) >= demand.gpu_count]
        if not nodes:
            listed = ", ".join(have) if have else "none"
            return (
                f"no worker has {demand.gpu_count} x {demand.gpu_type} GPU "
                f"(GPU types registered: {listed})"
            )
        kind = f" with {demand.gpu_count} x {demand.gpu_type}"
    return (
        f"no worker{kind} is large enough for cpu={demand.cpu:g}, memory={demand.memory} MiB "
        f"(largest: cpu={max(n.cpu for n in nodes):g}, "
        f"memory={max(n.memory for n in nodes)} MiB)"
    )
