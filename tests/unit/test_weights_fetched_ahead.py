"""Which weights a node fetches along with an image it fetches ahead
(`ReplicaSnapshots.fetch_weights_ahead`), before any fetch starts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.replicas.replica_images import ReplicaSnapshots
from ember_worker.snapshots.node_cache import image_name
from ember_worker.snapshots.snapshotter import Snapshotter
from ember_worker.snapshots.support import SnapshotSupport
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.origin import ObjectVersion

URL = "s3://weights/model.safetensors"
KEY, IMAGE_ID = "a" * 32, "i1"


def node(tmp_path: Path) -> tuple[ReplicaSnapshots, Path]:
    """A node's snapshot cache holding one image that maps a 1000-byte weights file."""
    objects = tmp_path / "weights" / "objects"
    objects.mkdir(parents=True)
    support = SnapshotSupport(None, "/usr/local/sbin/criu", "4.1.1", "env", True)
    root, server = tmp_path / "snapshots", "https://127.0.0.1:1"
    snapshotter = Snapshotter(support, root, server, "t", None, 10**9, weights_objects=objects)
    data = objects / (DiskCache.key(URL, ObjectVersion(size=1000, tag="v1")) + ".data")
    images = root / image_name(KEY, IMAGE_ID) / "images"
    images.mkdir(parents=True)
    meta = {
        "mapped_weights": [{"path": str(data), "size": 1000}],
        "weights": [{"url": URL, "s3_endpoint_url": None, "tag": "v1"}],
    }
    (images / "meta.json").write_text(json.dumps(meta))

    def never(*_: Any) -> Any:
        raise AssertionError("not called before a fetch")

    snapshots = ReplicaSnapshots(
        snapshotter,
        lazy_restore=False,
        huge_pages=False,
        gpu_node=False,
        note=never,
        send=never,
        spawn=never,
        take_gpus=never,
        replica_env=never,  # asked only when a fetch starts
    )
    return snapshots, data


def ahead(snapshots: ReplicaSnapshots, image_id: str, room: bool) -> tuple[str | None, list[int]]:
    asked: list[int] = []

    def room_for(size: int) -> bool:
        asked.append(size)
        return room

    command = wire.PrefetchSnapshot(key=KEY, image_id=image_id)
    return asyncio.run(snapshots.fetch_weights_ahead(command, room_for)), asked


def test_weights_that_do_not_fit_beside_the_cache_are_left_for_the_restore(
    tmp_path: Path,
) -> None:
    snapshots, _ = node(tmp_path)
    line, asked = ahead(snapshots, IMAGE_ID, room=False)
    assert asked == [1000]
    assert line is not None and "no room for them without evicting others" in line


def test_nothing_is_fetched_for_an_image_not_here_or_weights_already_whole(
    tmp_path: Path,
) -> None:
    snapshots, data = node(tmp_path)
    assert ahead(snapshots, "other-image", room=True) == (None, [])  # not fetched ahead
    data.write_bytes(b"\0" * 1000)
    (data.with_suffix(".chunks")).mkdir()
    (data.with_suffix(".chunks") / "0-1000").touch()
    assert ahead(snapshots, IMAGE_ID, room=True) == (None, [])
