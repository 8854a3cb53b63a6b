"""The cluster's side of snapshots: what workers report about the images they take and
restore (into the registry, the logs and the metrics), and the images offered to workers
to fetch ahead of need. Which replica snapshots or restores is lifecycle.py's to decide.
"""

from __future__ import annotations

from typing import Any

from ember_platform.core.cluster_model import EndpointRuntime, Worker
from ember_platform.core.live_state import LiveState
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.security.secrets import SecretRegistry
from ember_platform.snapshots.lifecycle import SnapshotRegistry, prefetch_workers
from ember_platform.storage.records import SnapshotRecord

# Worker reports about snapshots, as events in the metrics.
SNAPSHOT_EVENTS = {
    "snapshot_dumped": "dumped",
    "snapshot_taken": "published",
    "snapshot_failed": "take_failed",
    "restore_failed": "restore_failed",
}
# Reports that change no count.
QUIET_SNAPSHOT_REPORTS = ("take_declined",)


def image_dropped(workers: dict[str, Worker], key: str) -> None:
    """Every node frees its copies of a dropped image (one that restores from them
    would be told a newer image id anyway)."""
    for worker in workers.values():
        worker.send({"type": "forget_snapshot", "key": key})


class SnapshotReports:
    def __init__(
        self,
        state: LiveState,
        snapshots: SnapshotRegistry,
        secrets: SecretRegistry,
        logs: LogSink,
        metrics: PlatformMetrics,
    ) -> None:
        self.state = state
        self.snapshots = snapshots
        self.secrets = secrets
        self.logs = logs
        self.metrics = metrics

    def report(self, worker: Worker, kind: str, payload: dict[str, Any]) -> None:
        """A worker's report (one of SNAPSHOT_EVENTS or QUIET_SNAPSHOT_REPORTS)."""
        key = str(payload.get("key"))
        if kind in SNAPSHOT_EVENTS:
            self._count(kind, payload)
        image_id = str(payload.get("image_id") or "")
        if kind == "snapshot_dumped":
            self.snapshots.dumped(key, image_id)
        elif kind == "snapshot_taken":
            record = self.snapshots.taken(worker, payload)
            runtime = self.state.endpoints.get(record.label)
            if runtime is not None:
                self.logs.system(
                    runtime.app,
                    runtime.spec.name,
                    f"snapshot {key[:12]} stored ({record.size / 1e6:.0f} MB)",
                )
                self._offer(record, worker, runtime)
        elif kind == "snapshot_failed":
            self.snapshots.take_failed(key, str(payload.get("reason", "")))
        elif kind == "restore_failed":
            self.snapshots.restore_failed(key, image_id, str(payload.get("reason", "")))
            if payload.get("retake"):
                self._answer_retake(worker, key, str(payload.get("replica_id")))
        elif kind == "take_declined":
            self.snapshots.declined(key, str(payload.get("replica_id")))
        self.state.wake.set()  # the controller may now start replicas differently

    def offer_all(self, worker: Worker) -> None:
        """A node that joins, or is back in service, fetches ahead the images of the
        deployed endpoints it could restore and run, the newest first (each only if it
        fits in the node's cache beside the others)."""
        nodes = self.state.capacities()
        records = sorted(self.snapshots.ready.values(), key=lambda r: -r.created_at)
        for record in records:
            runtime = self.state.endpoints.get(record.label)
            if runtime is None or runtime.bundle_digest != record.bundle_digest:
                continue
            if prefetch_workers(record, "", [worker], nodes, runtime.demand()):
                worker.send(self._prefetch_message(record, runtime))

    def _prefetch_message(self, record: SnapshotRecord, runtime: EndpointRuntime) -> dict[str, Any]:
        """What has a worker fetch a published image ahead of need. An endpoint with
        `weights=` sends its environment too, as a replica's start does: the image may
        map weights files, which the worker then fetches with the replica's credentials."""
        message: dict[str, Any] = {
            "type": "prefetch_snapshot",
            "key": record.key,
            "label": record.label,
            "image_id": record.image_id,
            "raw_size": record.raw_size,
        }
        if runtime.settings.weights:
            message["env"] = self.secrets.replica_env(runtime.settings)
        return message

    def _answer_retake(self, worker: Worker, key: str, replica_id: str) -> None:
        """The replica whose restore failed boots cold: tell its worker whether it takes
        the new image at its quiet point (it waits for this answer there)."""
        replica = self.state.replicas.get(replica_id)
        granted = replica is not None and self.snapshots.retake(
            key, replica_id, worker.id, replica.endpoint.label
        )
        worker.send(
            {"type": "retake_snapshot", "replica_id": replica_id, "key": key, "granted": granted}
        )

    def _offer(self, record: SnapshotRecord, taker: Worker, runtime: EndpointRuntime) -> None:
        """Have the other workers that could restore the image fetch it now, before a
        replica waits for it."""
        targets = prefetch_workers(
            record,
            taker.id,
            self.state.workers.values(),
            self.state.capacities(),
            runtime.demand(),
        )
        for worker in targets:
            worker.send(self._prefetch_message(record, runtime))

    def _count(self, kind: str, payload: dict[str, Any]) -> None:
        replica = self.state.replicas.get(str(payload.get("replica_id")))
        label = str(payload.get("label"))
        runtime = replica.endpoint if replica else self.state.endpoints.get(label)
        if runtime is not None:
            self.metrics.snapshot_event(runtime.app, runtime.spec.name, SNAPSHOT_EVENTS[kind])
