"""The cluster's side of snapshots: what workers report about the images they take and
restore (into the registry, the logs and the metrics), and the images offered to workers
to fetch ahead of need. Which replica snapshots or restores is registry.py's to decide.
"""

from __future__ import annotations

from typing import assert_never

from ember.wire import messages as wire
from ember.wire.labels import split_app_key
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.cluster_model import EndpointRuntime, Worker
from ember_platform.runtime.live_state import LiveState
from ember_platform.security.secrets import SecretRegistry
from ember_platform.snapshots.registry import SnapshotRegistry, prefetch_workers
from ember_platform.storage.records import SnapshotRecord

# A worker's report about the images it takes and restores.
SnapshotReport = (
    wire.SnapshotDumped
    | wire.SnapshotTaken
    | wire.SnapshotFailed
    | wire.TakeDeclined
    | wire.RestoreFailed
)


def image_dropped(workers: dict[str, Worker], key: str) -> None:
    """Every node frees its copies of a dropped image (one that restores from them
    would be told a newer image id anyway)."""
    for worker in workers.values():
        worker.send(wire.ForgetSnapshot(key=key))


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

    def report(self, worker: Worker, report: SnapshotReport) -> None:
        """A worker's report about an image it took or restored."""
        self._count(report)
        key = report.key
        match report:
            case wire.SnapshotDumped():
                self.snapshots.dumped(key, report.image_id)
            case wire.SnapshotTaken():
                record = self.snapshots.taken(worker, report)
                runtime = self.state.endpoints.get(record.label)
                if runtime is not None:
                    self.logs.system(
                        runtime.app,
                        runtime.spec.name,
                        f"snapshot {key[:12]} stored ({record.size / 1e6:.0f} MB)",
                    )
                    self._offer(record, worker, runtime)
            case wire.SnapshotFailed():
                self.snapshots.take_failed(key, report.reason)
            case wire.RestoreFailed():
                self.snapshots.restore_failed(key, report.image_id, report.reason)
                if report.retake:
                    self._answer_retake(worker, key, report.replica_id)
            case wire.TakeDeclined():
                self.snapshots.declined(key, report.replica_id)
            case _:
                assert_never(report)
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

    def _prefetch_message(
        self, record: SnapshotRecord, runtime: EndpointRuntime
    ) -> wire.PrefetchSnapshot:
        """What has a worker fetch a published image ahead of need. An endpoint with
        `weights=` sends its environment too, as a replica's start does: the image may
        map weights files, which the worker then fetches with the replica's credentials."""
        return wire.PrefetchSnapshot(
            key=record.key,
            label=record.label,
            image_id=record.image_id,
            raw_size=record.raw_size,
            env=self._env(runtime) if runtime.settings.weights else None,
        )

    def _env(self, runtime: EndpointRuntime) -> dict[str, str]:
        return self.secrets.replica_env(split_app_key(runtime.app)[0], runtime.settings)

    def _answer_retake(self, worker: Worker, key: str, replica_id: str) -> None:
        """The replica whose restore failed boots cold: tell its worker whether it takes
        the new image at its quiet point (it waits for this answer there)."""
        replica = self.state.replicas.get(replica_id)
        granted = replica is not None and self.snapshots.retake(
            key, replica_id, worker.id, replica.endpoint.label
        )
        worker.send(wire.RetakeSnapshot(replica_id=replica_id, key=key, granted=granted))

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

    def _count(self, report: SnapshotReport) -> None:
        """Reports of takes and restores are counted in the metrics (a declined take
        changes no count)."""
        event = wire.SNAPSHOT_EVENTS.get(type(report))
        if event is None:
            return
        replica = self.state.replicas.get(report.replica_id)
        label = ""  # a restore's report names none: its replica's endpoint is counted
        if isinstance(report, wire.SnapshotDumped | wire.SnapshotTaken | wire.SnapshotFailed):
            label = report.label
        runtime = replica.endpoint if replica else self.state.endpoints.get(label)
        if runtime is not None:
            self.metrics.snapshot_event(runtime.app, runtime.spec.name, event)
