"""Which replica takes a snapshot and which ones restore: one take per key, restores on
the dumping worker as soon as the dump is done, everywhere once it is published."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from store_backends import StoreOpener

from ember.declarations.settings import EndpointSettings
from ember.wire import messages as wire
from ember_platform.scaling.scheduler import Demand, NodeCapacity
from ember_platform.snapshots.registry import (
    RETRY_FAILED_AFTER,
    FailedTake,
    SnapshotRegistry,
    blob_key,
    prefetch_workers,
    snapshot_key,
)
from ember_platform.storage.blobs import LocalBlobStore
from ember_platform.storage.records import SnapshotRecord

ENV_KEY = "env-1"


def runtime(bundle: str = "sha256:aa", snapshot: bool = True) -> Any:
    return SimpleNamespace(
        bundle_digest=bundle,
        entry="app.py",
        spec=SimpleNamespace(attribute="Model"),
        label="demo--model",
        settings=EndpointSettings(snapshot=snapshot),
    )


def worker(worker_id: str, env_key: str = ENV_KEY, problem: str | None = None) -> Any:
    return SimpleNamespace(
        id=worker_id, name=worker_id, snapshots={"env_key": env_key, "problem": problem}
    )


@pytest.fixture
def registry(tmp_path: Path, open_store: StoreOpener) -> SnapshotRegistry:
    store = open_store()  # on both backends
    return SnapshotRegistry(store, LocalBlobStore(tmp_path / "blobs"), budget_bytes=10_000)


def published(key: str, rt: Any, size: int = 100, image_id: str = "img1") -> wire.SnapshotTaken:
    return wire.SnapshotTaken(
        key=key,
        replica_id="r1",
        image_id=image_id,
        label=rt.label,
        bundle_digest=rt.bundle_digest,
        size=size,
        raw_size=size * 2,
        dump_seconds=0.5,
    )


def test_first_replica_takes_the_others_boot_cold_until_the_dump(
    registry: SnapshotRegistry,
) -> None:
    rt, w1 = runtime(), worker("w1")
    action, note = registry.plan(rt, w1, "r1")
    key = snapshot_key(rt, ENV_KEY)
    assert action == wire.SnapshotPlan(action="take", key=key) and note is None
    assert registry.plan(rt, w1, "r2") == (None, None)
    assert registry.plan(rt, worker("w2"), "r3") == (None, None)


def test_after_the_dump_only_the_dumping_worker_restores(registry: SnapshotRegistry) -> None:
    rt, w1, w2 = runtime(), worker("w1"), worker("w2")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    registry.dumped(action.key, "img1")
    restore = wire.SnapshotPlan(action="restore", key=action.key, image_id="img1")
    assert registry.plan(rt, w1, "r2") == (restore, None)
    assert registry.plan(rt, w2, "r3") == (None, None)
    registry.taken(w1, published(action.key, rt))
    assert registry.plan(rt, w2, "r4") == (restore, None)


def test_taken_is_recorded_even_when_the_replica_has_ended(
    tmp_path: Path, registry: SnapshotRegistry
) -> None:
    rt, w1 = runtime(), worker("w1")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    registry.dumped(action.key)
    registry.replica_gone("r1")  # scaled down while its image was being published
    assert registry.plan(rt, worker("w2"), "r2") == (None, None)  # not taken twice
    record = registry.taken(w1, published(action.key, rt))
    assert (record.label, record.bundle_digest, record.env_key) == (rt.label, "sha256:aa", ENV_KEY)
    again = SnapshotRegistry(registry.store, registry.blobs, registry.budget_bytes)
    assert action.key in again.ready  # kept in the state store


def test_replica_gone_before_its_dump_lets_the_next_one_take(registry: SnapshotRegistry) -> None:
    rt, w1 = runtime(), worker("w1")
    registry.plan(rt, w1, "r1")
    registry.replica_gone("r1")
    action, _ = registry.plan(rt, w1, "r2")
    assert action is not None and action.action == "take"


def test_worker_gone_while_publishing_lets_another_take(registry: SnapshotRegistry) -> None:
    rt, w1, w2 = runtime(), worker("w1"), worker("w2")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    registry.dumped(action.key)
    registry.worker_gone("w1")
    again, _ = registry.plan(rt, w2, "r2")
    assert again == wire.SnapshotPlan(action="take", key=action.key)


def test_failed_take_is_not_retried_at_once(registry: SnapshotRegistry) -> None:
    rt, w1 = runtime(), worker("w1")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    registry.take_failed(action.key)
    assert registry.plan(rt, w1, "r2") == (None, None)


def test_failed_restore_of_a_fresh_dump_stops_taking_for_a_while(
    registry: SnapshotRegistry,
) -> None:
    rt, w1 = runtime(), worker("w1")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    registry.dumped(action.key)
    registry.restore_failed(action.key)
    assert registry.plan(rt, w1, "r2") == (None, None)


def test_failed_restore_of_a_published_image_drops_it(registry: SnapshotRegistry) -> None:
    rt, w1 = runtime(), worker("w1")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    key = action.key
    registry.blobs.put(blob_key(key), b"image")
    registry.taken(w1, published(key, rt))
    registry.restore_failed(key)
    assert key not in registry.ready and not registry.blobs.exists(blob_key(key))
    assert registry.plan(rt, w1, "r2")[0] == wire.SnapshotPlan(action="take", key=key)


def test_keys_differ_by_bundle_and_environment() -> None:
    assert snapshot_key(runtime("sha256:aa"), "e1") != snapshot_key(runtime("sha256:bb"), "e1")
    assert snapshot_key(runtime(), "e1") != snapshot_key(runtime(), "e2")
    assert len(snapshot_key(runtime(), "e1")) == 32
    # The values of its secrets: an image holds them. Without secrets, keys stay as before.
    assert snapshot_key(runtime(), "e1", "d1") != snapshot_key(runtime(), "e1", "d2")
    assert snapshot_key(runtime(), "e1", "") == snapshot_key(runtime(), "e1")
    # The GPU choice a replica holds, of several.
    assert snapshot_key(runtime(), "e1", "", ("H100", 1)) != snapshot_key(
        runtime(), "e1", "", ("A100", 1)
    )


def test_snapshots_off_say_why(registry: SnapshotRegistry) -> None:
    assert registry.plan(runtime(snapshot=False), worker("w1"), "r1") == (None, None)
    action, note = registry.plan(runtime(), worker("w1", problem="no CRIU"), "r1")
    assert action is None and note is not None and "no CRIU" in note


def test_garbage_collection_drops_undeployed_then_oldest_past_budget(
    registry: SnapshotRegistry,
) -> None:
    old, new, gone = runtime("sha256:01"), runtime("sha256:02"), runtime("sha256:03")
    keys = []
    for i, rt in enumerate((old, new, gone)):
        key = snapshot_key(rt, ENV_KEY)
        registry.blobs.put(blob_key(key), b"x")
        record = registry.taken(worker("w1"), published(key, rt, size=6_000))
        registry.ready[key] = dataclasses.replace(record, created_at=float(i))
        keys.append(key)
    current = {(old.label, old.bundle_digest), (new.label, new.bundle_digest)}
    dropped = registry.collect_garbage(current)
    assert dropped == [keys[2], keys[0]]  # not deployed, then the oldest past 10 kB
    assert set(registry.ready) == {keys[1]}
    assert not registry.blobs.exists(blob_key(keys[0]))


def test_failed_takes_are_forgotten_once_their_endpoint_is_gone_or_their_wait_is_over(
    registry: SnapshotRegistry,
) -> None:
    deployed = runtime("sha256:01")
    registry.failed["a"] = FailedTake(deployed.label, time.time(), "CRIU dump timed out")
    registry.failed["b"] = FailedTake("stopped--model", time.time(), "CRIU dump timed out")
    registry.failed["c"] = FailedTake(deployed.label, time.time() - RETRY_FAILED_AFTER, "old")
    registry.collect_garbage({(deployed.label, deployed.bundle_digest)})
    assert set(registry.failed) == {"a"}


def test_a_published_image_is_offered_to_the_workers_that_could_restore_it() -> None:
    record = SnapshotRecord("k", "demo--model", "sha256:aa", ENV_KEY, 10, 20, 0.1, 0.0)
    workers = [
        worker("taker"),
        worker("same-env"),
        worker("other-env", env_key="env-2"),  # another Python or CPU: cannot restore it
        worker("no-criu", problem="CRIU is missing"),
        worker("small"),  # too small for a replica of the endpoint
        worker("unlabelled"),  # lacks the endpoint's node label
        worker("draining"),
    ]
    zone = {"zone": "eu"}
    nodes = [
        NodeCapacity("taker", 4, 4096, {}, labels=zone),
        NodeCapacity("same-env", 4, 4096, {}, memory_used=4000, labels=zone),  # busy now
        NodeCapacity("other-env", 4, 4096, {}, labels=zone),
        NodeCapacity("no-criu", 4, 4096, {}, labels=zone),
        NodeCapacity("small", 4, 256, {}, labels=zone),
        NodeCapacity("unlabelled", 4, 4096, {}),
        NodeCapacity("draining", 4, 4096, {}, labels=zone, draining=True),
    ]
    demand = Demand(1.0, 512, (), "sha256:aa", "demo--model", (("zone", "eu"),))
    chosen = prefetch_workers(record, "taker", workers, nodes, demand)
    assert [w.id for w in chosen] == ["same-env"]


def test_an_image_dropped_and_taken_again_is_a_new_image(registry: SnapshotRegistry) -> None:
    rt, w1 = runtime(), worker("w1")
    dropped: list[str] = []
    registry.on_drop = dropped.append
    key = snapshot_key(rt, ENV_KEY)
    registry.plan(rt, w1, "r1")
    registry.taken(w1, published(key, rt, image_id="old"))
    registry.restored(key, "old", 0.25)
    assert registry.ready[key].restores == 1 and registry.ready[key].last_restored_at
    assert registry.ready[key].last_restore_seconds == 0.25
    assert registry.forget_endpoint(rt.label) == ([key], 0)
    assert dropped == [key]  # the nodes are told to free their copies
    assert registry.plan(rt, w1, "r2")[0] == wire.SnapshotPlan(action="take", key=key)
    registry.taken(w1, published(key, rt, image_id="new"))
    # A node that still had the old image failed to restore it: the new one stays.
    assert not registry.restore_failed(key, "old", "corrupt")
    registry.restored(key, "old")  # nor is a restore from the old one counted
    record = registry.ready[key]
    assert (record.image_id, record.restores) == ("new", 0)
    again = SnapshotRegistry(registry.store, registry.blobs, registry.budget_bytes)
    assert again.ready[key].image_id == "new"  # kept in the state store with its id
    assert registry.restore_failed(key, "new", "corrupt") and key not in registry.ready


def test_forgetting_an_endpoint_lets_a_failed_take_be_tried_at_once(
    registry: SnapshotRegistry,
) -> None:
    rt, w1 = runtime(), worker("w1")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    registry.take_failed(action.key, "CRIU: Can't dump")
    failed = registry.failed[action.key]
    assert (failed.label, failed.reason) == (rt.label, "CRIU: Can't dump")
    assert registry.plan(rt, w1, "r2") == (None, None)
    assert registry.forget_endpoint(rt.label) == ([], 1)
    assert registry.plan(rt, w1, "r3")[0] == wire.SnapshotPlan(action="take", key=action.key)


def test_the_replica_whose_restore_failed_retakes_the_image_and_no_other(
    registry: SnapshotRegistry,
) -> None:
    rt, w1 = runtime(), worker("w1")
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    key = action.key
    registry.dumped(key, "img1")
    registry.taken(w1, published(key, rt, image_id="img1"))
    # r2 restored img1 and found it stale (or broken): it boots cold and retakes.
    assert registry.restore_failed(key, "img1", "the weights it holds changed")
    assert registry.retake(key, "r2", "w1", rt.label)
    assert registry.plan(rt, worker("w2"), "r3") == (None, None)  # boots cold, no take
    # r4's restore of img1 failed too, reported late: r2's take goes on, r4 does not retake.
    assert not registry.restore_failed(key, "img1", "late")
    assert key in registry.taking and not registry.retake(key, "r4", "w2", rt.label)
    registry.dumped(key, "img2")
    registry.taken(w1, published(key, rt, image_id="img2"))
    restore = wire.SnapshotPlan(action="restore", key=key, image_id="img2")
    assert registry.plan(rt, worker("w2"), "r5") == (restore, None)


def test_a_retake_declined_or_after_a_failed_fresh_image_leaves_the_key_to_the_next_start(
    registry: SnapshotRegistry,
) -> None:
    rt, w1 = runtime(), worker("w1")
    key = snapshot_key(rt, ENV_KEY)
    assert registry.retake(key, "r1", "w1", rt.label)
    registry.declined(key, "someone-else")  # not its take: kept
    assert key in registry.taking
    registry.declined(key, "r1")  # passed its quiet point before the answer
    assert registry.plan(rt, w1, "r2")[0] == wire.SnapshotPlan(action="take", key=key)
    # r2 dumps; a restore from that fresh image on w1 fails: no retake for a while.
    registry.dumped(key, "img1")
    assert registry.restore_failed(key, "img1", "CRIU said no")
    assert not registry.retake(key, "r3", "w1", rt.label)


def test_images_at_names_the_nodes_whose_cache_holds_the_image_a_replica_would_restore(
    registry: SnapshotRegistry,
) -> None:
    rt = runtime()
    w1, w2, w3 = worker("w1"), worker("w2"), worker("w3", env_key="env-2")
    for w in (w1, w2, w3):
        w.cached_snapshots = set()
    action, _ = registry.plan(rt, w1, "r1")
    assert action is not None
    key = action.key
    assert registry.images_at(rt, [w1, w2, w3]) == frozenset()  # not dumped yet
    registry.dumped(key, "img1")
    assert registry.images_at(rt, [w1, w2, w3]) == {("w1", None)}  # its own dump
    registry.taken(w1, published(key, rt))
    w1.cached_snapshots = {(key, "img1")}
    w2.cached_snapshots = {(key, "older")}  # another image of the key: not this one
    assert registry.images_at(rt, [w1, w2, w3]) == {("w1", None)}
    w2.cached_snapshots.add((key, "img1"))
    # w3's environment makes another key, whose image nobody took.
    w3.cached_snapshots = {(key, "img1")}
    assert registry.images_at(rt, [w1, w2, w3]) == {("w1", None), ("w2", None)}
    # Secrets' values and GPU choices are in the key too.
    assert registry.images_at(rt, [w1, w2], secrets_digest="s1") == frozenset()
    assert registry.images_at(rt, [w1, w2], gpus=[("H100", 1)]) == frozenset()
    assert registry.images_at(runtime(snapshot=False), [w1, w2]) == frozenset()
