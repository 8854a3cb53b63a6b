"""Whether this node has room for one more replica: the CPUs and memory its replicas were
placed for, against what the node offers (`--cpu`, `--memory`).

The control plane places replicas by the same sums, so a start it sends fits; but the
node is what they share, and it alone sees every replica it runs (those a control plane
that just took over does not know of yet, and, with several control planes, those of
the others). So it checks each start too, and refuses one past its room: the control
plane places it again elsewhere, as when a node has no GPU free; and its heartbeat says
what is booked, which the control plane counts from then on. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from ember_worker.agent.running_replica import RunningReplica

# Sums of float CPUs (0.1 + 0.2 ...) are not exact: within this, a start fits.
CPU_SLACK = 1e-6


def booked(running: Iterable[RunningReplica]) -> tuple[float, int]:
    """The CPUs and MiB the replicas whose processes live were placed for."""
    cpu = 0.0
    memory = 0
    for replica in running:
        if replica.process is not None and replica.process.returncode is not None:
            continue  # its process is gone: its share with it (its record goes soon)
        cpu += replica.cpu or 0.0
        memory += replica.memory_mib or 0
    return cpu, memory


def refusal(
    running: Iterable[RunningReplica],
    *,
    cpu: float,
    memory_mib: int,
    wants_cpu: float | None,
    wants_memory_mib: int | None,
) -> str | None:
    """Why a replica asking `wants_cpu` and `wants_memory_mib` does not fit beside those
    `running`; None when it fits (or asks for nothing)."""
    booked_cpu, booked_memory = booked(running)
    over_cpu = wants_cpu is not None and booked_cpu + wants_cpu > cpu + CPU_SLACK
    over_memory = wants_memory_mib is not None and booked_memory + wants_memory_mib > memory_mib
    if not over_cpu and not over_memory:
        return None
    return (
        f"the node's replicas have {booked_cpu:g} of its {cpu:g} CPUs and {booked_memory} of "
        f"its {memory_mib} MiB; this one asks {wants_cpu or 0:g} CPUs and "
        f"{wants_memory_mib or 0} MiB"
    )
