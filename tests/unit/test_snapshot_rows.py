"""What `ember snapshot ls` is told: a stored image's row (its version, the nodes that
hold it), takes in progress and failed, and why an endpoint has none."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ember.declarations.settings import EndpointSettings
from ember_platform.api.snapshots import endpoint_row, image_row, pending_rows
from ember_platform.snapshots.registry import RETRY_FAILED_AFTER, SnapshotRegistry
from ember_platform.storage.blobs import LocalBlobStore
from ember_platform.storage.records import SnapshotRecord
from ember_platform.storage.sqlite_store import SqliteStateStore

KEY = "ab" * 16


def runtime(version: int, bundle: str, snapshot: bool = True, note: str | None = None) -> Any:
    return SimpleNamespace(
        app="demo",
        label="demo--model",
        version=version,
        bundle_digest=bundle,
        entry="app.py",
        spec=SimpleNamespace(name="model", attribute="Model"),
        settings=EndpointSettings(snapshot=snapshot),
        snapshot_note=note,
    )


def cluster(tmp_path: Path, **runtimes: Any) -> Any:
    store = SqliteStateStore(tmp_path / "state.db")
    registry = SnapshotRegistry(store, LocalBlobStore(tmp_path / "blobs"), budget_bytes=10_000)
    workers = {
        "w1": SimpleNamespace(name="node-a", cached_snapshots={(KEY, "img1")}),
        "w2": SimpleNamespace(name="node-b", cached_snapshots={(KEY, "other")}),
    }
    serving = runtimes.get("serving")
    canary = runtimes.get("canary")
    return SimpleNamespace(
        snapshots=registry,
        workers=workers,
        endpoints={"demo--model": serving} if serving else {},
        canaries={"demo--model": canary} if canary else {},
    )


def record(bundle: str) -> SnapshotRecord:
    return SnapshotRecord(KEY, "demo--model", bundle, "env", 10, 20, 0.5, 100.0, "img1", 3)


def test_an_image_row_names_its_version_and_the_nodes_that_hold_that_image(
    tmp_path: Path,
) -> None:
    live = cluster(tmp_path, serving=runtime(4, "sha256:new"), canary=runtime(5, "sha256:try"))
    row = image_row(live, record("sha256:try"))
    assert (row["app"], row["endpoint"], row["state"], row["version"]) == (
        "demo",
        "model",
        "ready",
        5,
    )
    # node-b holds an older image of the same key: not this one.
    assert row["nodes"] == ["node-a"] and row["restores"] == 3
    assert image_row(live, record("sha256:gone"))["version"] is None  # not deployed now


def test_takes_in_progress_and_failed_ones(tmp_path: Path) -> None:
    live = cluster(tmp_path, serving=runtime(1, "sha256:aa"))
    worker = SimpleNamespace(id="w1", name="node-a", snapshots={"env_key": "env"})
    live.workers = {"w1": worker}
    action, _ = live.snapshots.plan(live.endpoints["demo--model"], worker, "r1")
    assert action is not None
    (taking,) = pending_rows(live)
    assert (taking["state"], taking["nodes"]) == ("taking", ["node-a"])
    live.snapshots.dumped(action.key, "img9")
    assert pending_rows(live)[0]["state"] == "publishing"
    live.snapshots.take_failed(action.key, "CRIU: Can't dump")
    (failed,) = pending_rows(live)
    assert failed["state"] == "failed" and failed["reason"] == "CRIU: Can't dump"
    assert failed["retry_at"] == failed["failed_at"] + RETRY_FAILED_AFTER


def test_an_endpoint_says_whether_it_snapshots_and_why_not() -> None:
    off = endpoint_row(runtime(1, "sha256:aa", snapshot=False))
    assert (off["label"], off["snapshot"], off["note"]) == ("demo--model", False, None)
    noted = endpoint_row(runtime(1, "sha256:aa", note="snapshots are off on worker a"))
    assert noted["snapshot"] and noted["note"] == "snapshots are off on worker a"


def test_a_workspace_images_row_names_its_workspace_and_its_app_there(tmp_path: Path) -> None:
    """`team--demo--model` is app demo of team: never app `team` of main, which would list
    it to main's tokens and hide it from team's."""
    live = cluster(tmp_path)
    stored = SnapshotRecord(KEY, "team--demo--model", "sha256:x", "env", 10, 20, 0.5, 1.0, "i", 0)
    row = image_row(live, stored)
    assert (row["workspace"], row["app"], row["endpoint"]) == ("team", "demo", "model")
    assert row["label"] == "team--demo--model"
    main = image_row(live, record("sha256:x"))
    assert (main["workspace"], main["app"], main["endpoint"]) == ("main", "demo", "model")
