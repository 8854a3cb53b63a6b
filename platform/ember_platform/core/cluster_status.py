"""What the control plane reports of its live state: a row per endpoint (with its
canary, rollout, schedule and snapshots) for the API, and the gauges read at each scrape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember_platform.core.scheduled_runs import schedule_status
from ember_platform.runtime.cluster_model import replica_states, rollout_status

if TYPE_CHECKING:
    from ember_platform.core.cluster import Cluster


def canary_status(cluster: Cluster, label: str) -> dict[str, Any] | None:
    canary = cluster.canaries.get(label)
    if canary is None:
        return None
    return {
        "version": canary.version,
        "percent": canary.canary_percent,
        "replicas": replica_states(canary),
        "queued": len(canary.pending),
        "running": sum(len(r.inflight) for r in canary.replicas.values()),
        "last_startup_error": canary.last_startup_error or None,
        "min_replicas": canary.settings.min_replicas,
        "outcomes": canary.outcomes.summary(),
    }


def endpoint_rows(cluster: Cluster) -> list[dict[str, Any]]:
    rows = []
    for runtime in sorted(cluster.endpoints.values(), key=lambda r: r.label):
        rows.append(
            {
                "app": runtime.app,
                "endpoint": runtime.spec.name,
                "label": runtime.label,
                "version": runtime.version,
                "kind": runtime.spec.kind,
                "methods": sorted(runtime.spec.methods),
                "settings": runtime.settings.to_dict(),  # with any override's
                "scaling_override": runtime.scaling_override or None,
                "replicas": replica_states(runtime),
                "queued": len(runtime.pending),
                "running": sum(len(r.inflight) for r in runtime.replicas.values()),
                # The largest replica's, as its worker last measured it: what
                # memory= (and memory_limit=) should be set by.
                "replica_memory_bytes": max(
                    (r.memory_bytes for r in runtime.replicas.values() if r.memory_bytes),
                    default=None,
                ),
                "unservable": cluster.roster.unservable_reason(runtime),
                "last_startup_error": runtime.last_startup_error or None,
                "placement_wait": runtime.placement_wait,
                "last_start": runtime.last_start or None,
                "snapshot_note": runtime.snapshot_note,
                "last_unhealthy": runtime.last_unhealthy,
                "rollout": rollout_status(runtime),
                "canary": canary_status(cluster, runtime.label),
                "schedule": schedule_status(cluster, runtime),
                "snapshots": [
                    {
                        "key": s.key,
                        "image_id": s.image_id,
                        "size": s.size,
                        "raw_size": s.raw_size,
                        "dump_seconds": s.dump_seconds,
                        "created_at": s.created_at,
                        "restores": s.restores,
                    }
                    for s in cluster.snapshots.for_label(runtime.label)
                ],
            }
        )
    return rows


def update_gauges(cluster: Cluster) -> None:
    """Gauges read at each scrape: queue depths, the nodes, their GPUs, replicas' memory."""
    cluster.metrics.set_load(
        (
            runtime.app,
            runtime.spec.name,
            len(runtime.pending),
            sum(len(r.inflight) for r in runtime.replicas.values()),
        )
        for runtime in cluster.state.runtimes()
    )
    cluster.metrics.set_held(
        (workspace, kind, size)
        for kind, held in (("bodies", cluster.state.bodies), ("answers", cluster.state.answers))
        for workspace, size in held.by_workspace().items()
    )
    on_node = cluster.state.replicas_by_worker()
    cluster.metrics.set_nodes(
        (w.name, on_node.get(w.id, 0), cluster.state.takes_no_replicas(w))
        for w in cluster.workers.values()
    )
    cluster.metrics.set_gpus(
        (worker.name, sample)
        for worker in cluster.workers.values()
        for sample in worker.gpu_samples
    )
    cluster.metrics.gpu_health.set(
        (worker.name, gpu.index, gpu.kind, gpu.state, gpu.fenced)
        for worker in cluster.workers.values()
        for gpu in worker.gpu_health
    )
    cluster.metrics.set_replica_memory(
        (replica.endpoint.app, replica.endpoint.spec.name, replica.id, replica.memory_bytes)
        for replica in cluster.replicas.values()
        if replica.memory_bytes is not None
    )
    cluster.metrics.set_replica_cpu_throttled(
        (replica.endpoint.app, replica.endpoint.spec.name, replica.id, waited)
        for replica in cluster.replicas.values()
        if (waited := replica.cpu_throttled_seconds) is not None
    )
