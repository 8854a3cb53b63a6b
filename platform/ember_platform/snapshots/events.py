"""The cluster's side of snapshots: what workers report about the images they take and
restore (into the registry, the logs and the metrics), and the images offered to workers
to fetch ahead of need. Which replica snapshots or restores is snapshots.py's to decide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember_platform.core.cluster_model import EndpointRuntime, Worker
from ember_platform.snapshots.lifecycle import prefetch_workers
from ember_platform.storage.records import SnapshotRecord

if TYPE_CHECKING:
    from ember_platform.core.cluster import Cluster

# Worker reports about snapshots, as events in the metrics.
SNAPSHOT_EVENTS = {
    "snapshot_dumped": "dumped",
    "snapshot_taken": "published",
    "snapshot_failed": "take_failed",
    "restore_failed": "restore_failed",
}
# Reports that change no count.
QUIET_SNAPSHOT_REPORTS = ("take_declined",)


def _prefetch_message(
    cluster: Cluster, record: SnapshotRecord, runtime: EndpointRuntime
) -> dict[str, Any]:
    """What has a worker fetch a published image ahead of need. An endpoint with
    `weights=` sends its environment too, as a replica's start does: the image may map
    weights files, which the worker then fetches with the replica's credentials."""
    message: dict[str, Any] = {
        "type": "prefetch_snapshot",
        "key": record.key,
        "label": record.label,
        "image_id": record.image_id,
        "raw_size": record.raw_size,
    }
    if runtime.settings.weights:
        message["env"] = cluster.replica_env(runtime)
    return message


def snapshot_event(cluster: Cluster, worker: Worker, kind: str, payload: dict[str, Any]) -> None:
    key = str(payload.get("key"))
    if kind in SNAPSHOT_EVENTS:
        _count_snapshot_event(cluster, kind, payload)
    image_id = str(payload.get("image_id") or "")
    if kind == "snapshot_dumped":
        cluster.snapshots.dumped(key, image_id)
    elif kind == "snapshot_taken":
        record = cluster.snapshots.taken(worker, payload)
        runtime = cluster.endpoints.get(record.label)
        if runtime is not None:
            cluster.logs.system(
                runtime.app,
                runtime.spec.name,
                f"snapshot {key[:12]} stored ({record.size / 1e6:.0f} MB)",
            )
            _offer_snapshot(cluster, record, worker, runtime)
    elif kind == "snapshot_failed":
        cluster.snapshots.take_failed(key, str(payload.get("reason", "")))
    elif kind == "restore_failed":
        cluster.snapshots.restore_failed(key, image_id, str(payload.get("reason", "")))
        if payload.get("retake"):
            _answer_retake(cluster, worker, key, str(payload.get("replica_id")))
    elif kind == "take_declined":
        cluster.snapshots.declined(key, str(payload.get("replica_id")))
    cluster.wake.set()  # the controller may now start replicas differently


def _answer_retake(cluster: Cluster, worker: Worker, key: str, replica_id: str) -> None:
    """The replica whose restore failed boots cold: tell its worker whether it takes the
    new image at its quiet point (it waits for this answer there)."""
    replica = cluster.replicas.get(replica_id)
    granted = replica is not None and cluster.snapshots.retake(
        key, replica_id, worker.id, replica.endpoint.label
    )
    worker.send(
        {"type": "retake_snapshot", "replica_id": replica_id, "key": key, "granted": granted}
    )


def image_dropped(cluster: Cluster, key: str) -> None:
    """Every node frees its copies of a dropped image (one that restores from them
    would be told a newer image id anyway)."""
    for worker in cluster.workers.values():
        worker.send({"type": "forget_snapshot", "key": key})


def _offer_snapshot(
    cluster: Cluster, record: SnapshotRecord, taker: Worker, runtime: EndpointRuntime
) -> None:
    """Have the other workers that could restore the image fetch it now, before a
    replica waits for it."""
    targets = prefetch_workers(
        record, taker.id, cluster.workers.values(), cluster.capacities(), runtime.demand()
    )
    for worker in targets:
        worker.send(_prefetch_message(cluster, record, runtime))


def offer_snapshots(cluster: Cluster, worker: Worker) -> None:
    """A node that joins, or is back in service, fetches ahead the images of the
    deployed endpoints it could restore and run, the newest first (each only if it
    fits in the node's cache beside the others)."""
    nodes = cluster.capacities()
    records = sorted(cluster.snapshots.ready.values(), key=lambda r: -r.created_at)
    for record in records:
        runtime = cluster.endpoints.get(record.label)
        if runtime is None or runtime.bundle_digest != record.bundle_digest:
            continue
        if prefetch_workers(record, "", [worker], nodes, runtime.demand()):
            worker.send(_prefetch_message(cluster, record, runtime))


def _count_snapshot_event(cluster: Cluster, kind: str, payload: dict[str, Any]) -> None:
    replica = cluster.replicas.get(str(payload.get("replica_id")))
    runtime = replica.endpoint if replica else cluster.endpoints.get(str(payload.get("label")))
    if runtime is not None:
        event = SNAPSHOT_EVENTS[kind]
        cluster.metrics.snapshot_event(runtime.app, runtime.spec.name, event)
