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
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.wire import messages as wire
from ember_platform.scaling.scheduler import Demand, NodeCapacity
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.records import SnapshotRecord
from ember_platform.storage.state_store import StateStore, StoreWriteError

if TYPE_CHECKING:
    from ember_platform.runtime.cluster_model import EndpointRuntime, Worker

SNAPSHOT_KEY = re.compile(r"[0-9a-f]{32}\Z")  # what `snapshot_key` makes
RETRY_FAILED_AFTER = 600.0  # a failed snapshot is not attempted again for this long
log = logging.getLogger("ember.snapshots")


SNAPSHOT_BLOBS = "snapshots/"


def blob_key(key: str) -> str:
    return SNAPSHOT_BLOBS + key


def snapshot_key(
    runtime: EndpointRuntime,
    env_key: str,
    secrets_digest: str = "",
    gpu: tuple[str, int] | None = None,
    gang: tuple[int, int] | None = None,
) -> str:
    """Everything that must match to restore: the code, the endpoint, the replica's frozen
    settings, the worker's environment (Python, torch, CRIU, kernel, CPU, GPU), the
    values of the endpoint's secrets (an image holds them in its memory) and the GPU
    choice the replica holds (of several, each has images of its own), the digest of
    the endpoint's `image=` (its root file system) when it has one, and a gang member's
    (rank, size): each rank has an image of its own (what it loaded may be its share)."""
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
    image = runtime.settings.image_digest
    if image is not None:
        parts["image"] = image
    if gpu is not None:
        parts["gpu"] = f"{gpu[0]}:{gpu[1]}"
    if gang is not None:
        parts["gang"] = f"{gang[0]}/{gang[1]}"
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
    label: str
    dumped: bool = False  # the image is in that worker's cache; the replica runs on
    image_id: str = ""  # the dump's, once it is done


@dataclass(frozen=True)
class FailedTake:
    label: str
    at: float
    reason: str


class SnapshotRegistry:
    def __init__(
        self,
        store: StateStore,
        blobs: BlobStore,
        budget_bytes: int,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.budget_bytes = budget_bytes
        self.on_drop = on_drop  # told each key dropped, so nodes can free their copies
        self.ready: dict[str, SnapshotRecord] = {s.key: s for s in store.list_snapshots()}
        self.taking: dict[str, TakeInProgress] = {}
        self.failed: dict[str, FailedTake] = {}  # key -> the take that failed

    def plan(
        self,
        runtime: EndpointRuntime,
        worker: Worker,
        replica_id: str,
        secrets_digest: str = "",
        gpu: tuple[str, int] | None = None,
        gang: tuple[int, int] | None = None,
    ) -> tuple[wire.SnapshotPlan | None, str | None]:
        """(what the replica does with a snapshot, or None: boot cold; a note on why
        snapshots are off). A gang member's (`gang`: its rank, the gang's size) is its
        rank's."""
        if not runtime.settings.snapshot:
            return None, None
        support = worker.snapshots
        if support.get("problem") or not support.get("env_key"):
            reason = support.get("problem") or "the worker does not support snapshots"
            return None, f"snapshots are off on worker {worker.name}: {reason}"
        key = snapshot_key(runtime, str(support["env_key"]), secrets_digest, gpu, gang)
        record = self.ready.get(key)
        if record is not None:
            return wire.SnapshotPlan(action="restore", key=key, image_id=record.image_id), None
        take = self.taking.get(key)
        if take is not None:
            if take.dumped and take.worker_id == worker.id:
                # From that worker's cache, before it is published.
                return wire.SnapshotPlan(action="restore", key=key, image_id=take.image_id), None
            return None, None  # one replica takes it; the others boot cold meanwhile
        failed = self.failed.get(key)
        if failed is not None and time.time() - failed.at < RETRY_FAILED_AFTER:
            return None, None
        self.taking[key] = TakeInProgress(replica_id, worker.id, runtime.label)
        return wire.SnapshotPlan(action="take", key=key), None

    def images_at(
        self,
        runtime: EndpointRuntime,
        workers: Iterable[Worker],
        secrets_digest: str = "",
        gpus: Sequence[tuple[str, int] | None] = (None,),
    ) -> frozenset[tuple[str, tuple[str, int] | None]]:
        """(worker id, GPU choice) where a replica of `runtime` would restore, as `plan`
        decides, from an image that node already holds: the published one in its cache
        (as its heartbeats list them), or its own dump not yet published."""
        if not runtime.settings.snapshot:
            return frozenset()
        found = set()
        for worker in workers:
            env_key = worker.snapshots.get("env_key")
            if worker.snapshots.get("problem") or not env_key:
                continue
            for gpu in gpus:
                key = snapshot_key(runtime, str(env_key), secrets_digest, gpu)
                record = self.ready.get(key)
                if record is not None:
                    held = (key, record.image_id) in worker.cached_snapshots
                else:
                    take = self.taking.get(key)
                    held = take is not None and take.dumped and take.worker_id == worker.id
                if held:
                    found.add((worker.id, gpu))
        return frozenset(found)

    def dumped(self, key: str, image_id: str = "") -> None:
        """The image is in its worker's cache; from now on the take no longer depends on
        the replica, only on its worker (which publishes the image)."""
        take = self.taking.get(key)
        if take is not None:
            take.dumped = True
            take.image_id = image_id

    def taken(self, worker: Worker, report: wire.SnapshotTaken) -> SnapshotRecord:
        """The image is published. Its label and bundle come with the report, since the
        replica that was dumped may have ended meanwhile."""
        key = report.key
        self.taking.pop(key, None)
        self.failed.pop(key, None)
        record = SnapshotRecord(
            key=key,
            label=report.label,
            bundle_digest=report.bundle_digest,
            env_key=str(worker.snapshots.get("env_key")),
            size=report.size,
            raw_size=report.raw_size,
            dump_seconds=report.dump_seconds,
            created_at=time.time(),
            image_id=report.image_id,
        )
        self.ready[key] = record
        self._record(record)
        return record

    def _record(self, record: SnapshotRecord) -> None:
        try:
            self.store.put_snapshot(record)
        except StoreWriteError as error:  # in use all the same; a restart takes a new one
            log.warning(
                "snapshot %s is not recorded in the state store: %s", record.key[:12], error
            )

    def restored(self, key: str, image_id: str = "", seconds: float | None = None) -> None:
        """A replica was restored from the image, ready `seconds` after it was placed:
        counted, for `ember snapshot ls`."""
        record = self.ready.get(key)
        if record is None or (image_id and record.image_id and image_id != record.image_id):
            return  # from a take not yet published, or a dropped image a node still had
        record.restores += 1
        record.last_restored_at = time.time()
        record.last_restore_seconds = seconds
        self._record(record)

    def take_failed(self, key: str, reason: str = "") -> None:
        take = self.taking.pop(key, None)
        label = take.label if take is not None else ""
        self.failed[key] = FailedTake(label, time.time(), reason)

    def restore_failed(self, key: str, image_id: str = "", reason: str = "") -> bool:
        """The image would not restore (corrupt, missing): drop it; the next replica
        takes a fresh one. A fresh image that fails is not taken again for a while.
        False when the image that failed is not the current one of its key (a node's
        copy of an image dropped since): the current one stays."""
        record = self.ready.get(key)
        if record is not None and image_id and record.image_id and image_id != record.image_id:
            return False
        take = self.taking.get(key)
        if record is None and take is not None and image_id and take.image_id != image_id:
            return False  # about an image dropped before this take began: it goes on
        self.taking.pop(key, None)
        if take is not None:
            self.failed[key] = FailedTake(take.label, time.time(), f"its restore failed: {reason}")
        self.drop(key)
        return True

    def retake(self, key: str, replica_id: str, worker_id: str, label: str) -> bool:
        """A replica whose restore failed boots cold instead: it takes the new image,
        unless another replica already does or the key's last take failed lately.
        Whether it may."""
        if key in self.ready or key in self.taking:
            return False
        failed = self.failed.get(key)
        if failed is not None and time.time() - failed.at < RETRY_FAILED_AFTER:
            return False
        self.taking[key] = TakeInProgress(replica_id, worker_id, label)
        return True

    def declined(self, key: str, replica_id: str) -> None:
        """The replica allowed to retake passed its quiet point before it knew: no dump
        comes, and the next start may take the image."""
        take = self.taking.get(key)
        if take is not None and take.replica_id == replica_id and not take.dumped:
            del self.taking[key]

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
        if self.on_drop is not None:
            self.on_drop(key)

    def blob_unwanted(self, blob: str) -> bool | None:
        """Whether a snapshot image whose delete failed should still go (blob_deletes.py):
        unless its key was taken again since; None for a blob not of snapshots."""
        if not blob.startswith(SNAPSHOT_BLOBS):
            return None
        key = blob[len(SNAPSHOT_BLOBS) :]
        return key not in self.ready and key not in self.taking

    def forget_endpoint(self, label: str) -> tuple[list[str], int]:
        """`ember snapshot rm`: drop every image of the endpoint and forget its failed
        takes, so that the next replica to start takes a new one at once. (dropped keys,
        failures forgotten)."""
        dropped = [record.key for record in self.for_label(label)]
        for key in dropped:
            self.drop(key)
        failures = [key for key, failed in self.failed.items() if failed.label == label]
        for key in failures:
            del self.failed[key]
        return dropped, len(failures)

    def for_label(self, label: str) -> list[SnapshotRecord]:
        return [s for s in self.ready.values() if s.label == label]

    def collect_garbage(self, current: set[tuple[str, str]]) -> list[str]:
        """Drop images of code no longer deployed, then the oldest beyond the budget.
        Failed takes are forgotten once their endpoint is gone or their wait is over
        (a stopped app's failure was listed for good otherwise)."""
        labels = {label for label, _ in current}
        now = time.time()
        for key, failed in list(self.failed.items()):
            if failed.label not in labels or now - failed.at >= RETRY_FAILED_AFTER:
                del self.failed[key]
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
