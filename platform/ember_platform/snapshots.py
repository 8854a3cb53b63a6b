"""Which replica takes an endpoint's snapshot, which ones restore from it, and when
images are collected. Workers do the dumping and restoring; this only decides.

A snapshot goes through two steps on the worker that takes it: the dump (after which
the replica serves on and the image is in that worker's cache, so replicas starting on
that worker restore from it at once), then the publish (compressed and uploaded to the
blob store, after which replicas on every worker restore from it). Once published, the
image is offered to the other workers that could restore it (`prefetch_workers`), which
fetch it into their caches in the background: the first restore on each then skips the
download, which for a large model is most of a restore's time."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember_platform.blobs import BlobStore
from ember_platform.records import SnapshotRecord
from ember_platform.scheduler import Demand, NodeCapacity
from ember_platform.store import StateStore, StoreWriteError

if TYPE_CHECKING:
    from ember_platform.cluster import EndpointRuntime, Worker

RETRY_FAILED_AFTER = 600.0  # a failed snapshot is not attempted again for this long
log = logging.getLogger("ember.snapshots")


def blob_key(key: str) -> str:
    return f"snapshots/{key}"


def snapshot_key(
    runtime: EndpointRuntime,
    env_key: str,
    secrets_digest: str = "",
    gpu: tuple[str, int] | None = None,
) -> str:
    """Everything that must match to restore: the code, the endpoint, the replica's frozen
    settings, the worker's environment (Python, torch, CRIU, kernel, CPU, GPU), the
    values of the endpoint's secrets (an image holds them in its memory) and the GPU
    choice the replica holds (of several, each has images of its own)."""
    parts = {
        "bundle": runtime.bundle_digest,
        "entry": runtime.entry,
        "attribute": runtime.spec.attribute,
        "label": runtime.label,
        "concurrency": runtime.settings.concurrency,
        "env": env_key,
    }
    if secrets_digest:
        parts["secrets"] = secrets_digest
    if gpu is not None:
        parts["gpu"] = f"{gpu[0]}:{gpu[1]}"
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def prefetch_workers(
    record: SnapshotRecord,
    taker_id: str,
    workers: Iterable[Worker],
    nodes: Sequence[NodeCapacity],
    demand: Demand,
) -> list[Worker]:
    """The workers to offer a published image: those, other than the one that took it,
    that could restore it (snapshots on, the same environment key) and could run the
    endpoint's replicas (its labels, its GPUs, its size), draining ones aside."""
    could_run = {n.worker_id for n in nodes if not n.draining and n.could_ever_fit(demand)}
    return [
        worker
        for worker in workers
        if worker.id != taker_id
        and worker.id in could_run
        and not worker.snapshots.get("problem")
        and worker.snapshots.get("env_key") == record.env_key
    ]


@dataclass
class TakeInProgress:
    replica_id: str  # the replica being dumped
    worker_id: str  # the worker dumping it, and publishing the image afterwards
    dumped: bool = False  # the image is in that worker's cache; the replica runs on


class SnapshotRegistry:
    def __init__(self, store: StateStore, blobs: BlobStore, budget_bytes: int) -> None:
        self.store = store
        self.blobs = blobs
        self.budget_bytes = budget_bytes
        self.ready: dict[str, SnapshotRecord] = {s.key: s for s in store.list_snapshots()}
        self.taking: dict[str, TakeInProgress] = {}
        self.failed: dict[str, float] = {}  # key -> when taking it failed

    def plan(
        self,
        runtime: EndpointRuntime,
        worker: Worker,
        replica_id: str,
        secrets_digest: str = "",
        gpu: tuple[str, int] | None = None,
    ) -> tuple[dict[str, str] | None, str | None]:
        """(the replica's snapshot action, or None; a note on why snapshots are off)."""
        if not runtime.settings.snapshot:
            return None, None
        support = worker.snapshots
        if support.get("problem") or not support.get("env_key"):
            reason = support.get("problem") or "the worker does not support snapshots"
            return None, f"snapshots are off on worker {worker.name}: {reason}"
        key = snapshot_key(runtime, str(support["env_key"]), secrets_digest, gpu)
        if key in self.ready:
            return {"action": "restore", "key": key}, None
        take = self.taking.get(key)
        if take is not None:
            if take.dumped and take.worker_id == worker.id:
                return {"action": "restore", "key": key}, None  # from that worker's cache
            return None, None  # one replica takes it; the others boot cold meanwhile
        if time.time() - self.failed.get(key, 0.0) < RETRY_FAILED_AFTER:
            return None, None
        self.taking[key] = TakeInProgress(replica_id, worker.id)
        return {"action": "take", "key": key}, None

    def dumped(self, key: str) -> None:
        """The image is in its worker's cache; from now on the take no longer depends on
        the replica, only on its worker (which publishes the image)."""
        take = self.taking.get(key)
        if take is not None:
            take.dumped = True

    def taken(self, worker: Worker, payload: dict[str, Any]) -> SnapshotRecord:
        """The image is published. Its label and bundle come with the report, since the
        replica that was dumped may have ended meanwhile."""
        key = str(payload["key"])
        self.taking.pop(key, None)
        record = SnapshotRecord(
            key=key,
            label=str(payload["label"]),
            bundle_digest=str(payload["bundle_digest"]),
            env_key=str(worker.snapshots.get("env_key")),
            size=int(payload.get("size", 0)),
            raw_size=int(payload.get("raw_size", 0)),
            dump_seconds=float(payload.get("dump_seconds", 0.0)),
            created_at=time.time(),
        )
        self.ready[key] = record
        try:
            self.store.put_snapshot(record)
        except StoreWriteError as error:  # in use all the same; a restart takes a new one
            log.warning("snapshot %s is not recorded in the state store: %s", key[:12], error)
        return record

    def take_failed(self, key: str) -> None:
        self.taking.pop(key, None)
        self.failed[key] = time.time()

    def restore_failed(self, key: str) -> None:
        """The image would not restore (corrupt, missing): drop it; the next replica
        takes a fresh one. A fresh image that fails is not taken again for a while."""
        if self.taking.pop(key, None) is not None:
            self.failed[key] = time.time()
        self.drop(key)

    def replica_gone(self, replica_id: str) -> None:
        """A replica ended: a dump it was waiting for will not come."""
        for key, take in list(self.taking.items()):
            if take.replica_id == replica_id and not take.dumped:
                del self.taking[key]

    def worker_gone(self, worker_id: str) -> None:
        """A worker left: its dumps and publishes in progress will not finish."""
        for key, take in list(self.taking.items()):
            if take.worker_id == worker_id:
                del self.taking[key]

    def drop(self, key: str) -> None:
        self.ready.pop(key, None)
        try:
            self.store.delete_snapshot(key)
        except StoreWriteError as error:  # after a restart its restores fail and drop it
            log.warning("snapshot %s is still in the state store: %s", key[:12], error)
        self.blobs.delete(blob_key(key))

    def for_label(self, label: str) -> list[SnapshotRecord]:
        return [s for s in self.ready.values() if s.label == label]

    def collect_garbage(self, current: set[tuple[str, str]]) -> list[str]:
        """Drop images of code no longer deployed, then the oldest beyond the budget."""
        dropped = []
        for record in list(self.ready.values()):
            if (record.label, record.bundle_digest) not in current:
                self.drop(record.key)
                dropped.append(record.key)
        total = sum(r.size for r in self.ready.values())
        for record in sorted(self.ready.values(), key=lambda r: r.created_at):
            if total <= self.budget_bytes:
                break
            self.drop(record.key)
            total -= record.size
            dropped.append(record.key)
        return dropped
