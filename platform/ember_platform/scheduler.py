"""Placement: which worker node runs a new replica. Pure functions over capacities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

GpuChoice = tuple[str, int]  # (type, count)


@dataclass(frozen=True)
class Demand:
    cpu: float
    memory: int  # MiB
    gpus: tuple[GpuChoice, ...]  # choices in order of preference; () for none
    bundle_digest: str


@dataclass(frozen=True)
class Placement:
    worker_id: str
    gpu: GpuChoice | None  # the choice it runs with


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

    def fits(self, demand: Demand, gpu: GpuChoice | None = None) -> bool:
        """Room for the demand now, with GPU choice `gpu` (None: any of its choices)."""
        if self.cpu - self.cpu_used < demand.cpu - 1e-9:
            return False
        if self.memory - self.memory_used < demand.memory:
            return False
        choices = demand.gpus if gpu is None else (gpu,)
        return not choices or any(
            self.gpus.get(kind, 0) - self.gpus_used.get(kind, 0) >= count for kind, count in choices
        )

    def could_ever_fit(self, demand: Demand) -> bool:
        empty = NodeCapacity(self.worker_id, self.cpu, self.memory, self.gpus)
        return empty.fits(demand)


def place(demand: Demand, nodes: Sequence[NodeCapacity]) -> Placement | None:
    """Where to start a replica, and with which GPU choice; None if every node is full
    right now.

    GPU choices go in the endpoint's order: a later one only when no node has the earlier
    ones free. Among the nodes that fit, one that already holds the bundle (no download)
    comes first, then the one with the most free CPU, so replicas spread out.
    """
    for gpu in demand.gpus or (None,):
        candidates = [n for n in nodes if n.fits(demand, gpu)]
        if candidates:
            best = max(
                candidates,
                key=lambda n: (demand.bundle_digest in n.bundles, n.cpu - n.cpu_used, n.worker_id),
            )
            return Placement(best.worker_id, gpu)
    return None


def unservable_reason(demand: Demand, nodes: Sequence[NodeCapacity]) -> str | None:
    """Why no registered node could ever run this replica, or None if one could."""
    if any(n.could_ever_fit(demand) for n in nodes):
        return None
    if not nodes:
        return "no worker nodes are registered; start one with `ember worker --server URL`"
    kind = ""
    if demand.gpus:
        have = sorted({g for n in nodes for g in n.gpus})
        wanted = " or ".join(f"{count} x {gpu}" for gpu, count in demand.gpus)
        nodes = [n for n in nodes if any(n.gpus.get(gpu, 0) >= count for gpu, count in demand.gpus)]
        if not nodes:
            listed = ", ".join(have) if have else "none"
            return f"no worker has {wanted} GPU (GPU types registered: {listed})"
        kind = f" with {wanted}"
    return (
        f"no worker{kind} is large enough for cpu={demand.cpu:g}, memory={demand.memory} MiB "
        f"(largest: cpu={max(n.cpu for n in nodes):g}, "
        f"memory={max(n.memory for n in nodes)} MiB)"
    )
