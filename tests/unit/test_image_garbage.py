"""Collection of images on the control plane's side (platform/ember_platform/images/):
blobs no built image names, once old enough (blob_garbage.py), a build's uploaded files
once it ends (builds.py), and the nodes told which images deployments run on and which
was dropped (node_copies.py). Against a real folder blob store."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from cluster_harness import APP, Env, hello, make_env, run

import ember
from ember.wire import messages as wire
from ember_platform.images.blob_garbage import (
    ImageBlobGarbage,
    StoredImages,
    read_stored,
    unnamed_blobs,
)
from ember_platform.images.blob_keys import blob_key, files_key, layer_key, record_key
from ember_platform.images.builds import ImageBuilds
from ember_platform.runtime.cluster_model import Worker
from ember_platform.runtime.live_state import LiveState
from ember_platform.storage.blobs import LocalBlobStore

DAY = 86400.0
NOW = 1_000 * DAY


def _hex(char: str) -> str:
    return char * 64


def _layer(digest: str, tar: str) -> dict[str, object]:
    return {"digest": "sha256:" + digest, "sha256": tar, "size": 10, "kind": "run"}


def test_the_policy_keeps_what_records_and_builds_name_and_what_is_young() -> None:
    built = {"layers": [_layer(_hex("a"), _hex("1"))], "lazy_index": {"sha256": _hex("9")}}
    stored = StoredImages(
        records=[built],
        layers={
            _hex("a"): ({"sha256": _hex("1")}, NOW - 30 * DAY),  # a built image's
            _hex("b"): ({"sha256": _hex("2")}, NOW - 8 * DAY),  # a failed build's, old
            _hex("c"): ({"sha256": _hex("3")}, NOW - 1 * DAY),  # a failed build's, young
            _hex("d"): ({"sha256": _hex("4")}, NOW - 30 * DAY),  # a running build's
            _hex("e"): ({"sha256": _hex("1")}, NOW - 30 * DAY),  # shares a built tar
        },
        tars={blob_key(h): NOW - 30 * DAY for h in (_hex("1"), _hex("2"), _hex("3"), _hex("4"))}
        | {
            blob_key(_hex("9")): NOW - 30 * DAY,  # the built image's file index
            blob_key(_hex("5")): NOW - 8 * DAY,  # no entry names it (an upload cut short)
            blob_key(_hex("6")): NOW - 60.0,  # likewise, young: a build may be writing it
            blob_key("partial-0011"): NOW - 8 * DAY,
        },
        files={
            files_key(_hex("7")): NOW - 2 * DAY,  # no build used it
            files_key(_hex("8")): NOW - 2 * DAY,  # a running build's
            files_key(_hex("f")): NOW - 600.0,  # just uploaded
        },
    )
    doomed = unnamed_blobs(
        stored,
        now=NOW,
        building_layers={"sha256:" + _hex("d")},
        building_files={_hex("8")},
    )
    assert doomed == [
        layer_key(_hex("b")),
        layer_key(_hex("e")),
        blob_key(_hex("2")),
        blob_key(_hex("5")),
        blob_key("partial-0011"),
        files_key(_hex("7")),
    ]
    # Layer entries go before their tars: a builder never finds an entry without one.
    assert doomed.index(layer_key(_hex("b"))) < doomed.index(blob_key(_hex("2")))


def _aged(root: Path, key: str, data: bytes, age: float) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (NOW - age, NOW - age))


def test_collection_against_a_folder_store(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path)
    now = NOW
    record = {"layers": [_layer(_hex("a"), _hex("1"))]}
    _aged(tmp_path, record_key(_hex("a")), json.dumps(record).encode(), 30 * DAY)
    _aged(tmp_path, layer_key(_hex("a")), json.dumps({"sha256": _hex("1")}).encode(), 30 * DAY)
    _aged(tmp_path, layer_key(_hex("b")), json.dumps({"sha256": _hex("2")}).encode(), 30 * DAY)
    for tar in (_hex("1"), _hex("2")):
        _aged(tmp_path, blob_key(tar), b"tar", 30 * DAY)
    stored = read_stored(blobs)
    assert [r["layers"][0]["sha256"] for r in stored.records] == [_hex("1")]
    assert sorted(stored.layers) == [_hex("a"), _hex("b")]
    doomed = unnamed_blobs(stored, now=now)
    assert doomed == [layer_key(_hex("b")), blob_key(_hex("2"))]
    # The real run (today's clock: the store's files are older than any limit).
    assert ImageBlobGarbage(blobs).collect(set(), set()) == doomed
    assert blobs.exists(record_key(_hex("a"))) and blobs.exists(blob_key(_hex("1")))
    assert not blobs.exists(layer_key(_hex("b"))) and not blobs.exists(blob_key(_hex("2")))


def test_the_owners_controller_collects_image_blobs(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        _aged(
            env.config.blob_dir,
            layer_key(_hex("b")),
            b'{"sha256": "' + _hex("2").encode() + b'"}',
            30 * DAY,
        )
        _aged(env.config.blob_dir, blob_key(_hex("2")), b"tar", 30 * DAY)
        env.tick()  # its first tick collects, as one every 5 minutes does
        task = env.cluster.image_blobs._task
        assert task is not None
        assert await task == [layer_key(_hex("b")), blob_key(_hex("2"))]

    run(tmp_path, scenario)


def _worker(name: str) -> Worker:
    return Worker(id="w-" + name, name=name, cpu=4, memory=1 << 30, gpus={})


def _sent(worker: Worker) -> list[wire.ToAgent]:
    found = []
    while not worker.outbox.empty():
        found.append(wire.to_agent(worker.outbox.get_nowait()))
    return found


def test_a_builds_uploaded_files_go_when_it_ends_unless_uploaded_again(tmp_path: Path) -> None:
    async def scenario() -> None:
        blobs = LocalBlobStore(tmp_path)
        node = _worker("n")
        state = LiveState(draining_nodes=set())
        state.workers = {node.id: node}
        garbage = ImageBlobGarbage(blobs)
        runs = ImageBuilds(state, garbage)
        image = ember.Image.debian_slim().run_commands("true").to_dict()
        for sha in (_hex("1"), _hex("2")):
            blobs.put(files_key(sha), b"files")
            os.utime(tmp_path / files_key(sha), (1.0, 1.0))  # uploaded before the build
        build = runs.start(image, {"sha256:" + _hex("a"): _hex("1")}, {})
        other = runs.start(
            ember.Image.debian_slim().run_commands("false").to_dict(),
            {"sha256:" + _hex("b"): _hex("2")},
            {},
        )
        layers, files = runs.building()
        assert files == {_hex("1"), _hex("2")}
        assert {s["digest"] for s in image["steps"]} <= layers
        runs.message(node, wire.ImageBuildDone(build_id=build.id, error="step 2 failed"))
        await asyncio.gather(*garbage._deletes)
        assert not blobs.exists(files_key(_hex("1")))
        assert blobs.exists(files_key(_hex("2")))  # its build runs on
        blobs.put(files_key(_hex("2")), b"files")  # another deploy uploads them again
        runs.message(node, wire.ImageBuildDone(build_id=other.id))
        await asyncio.gather(*garbage._deletes)
        assert blobs.exists(files_key(_hex("2")))  # it will ask for a build of them
        assert runs.building() == (set(), set())

    asyncio.run(scenario())


def test_nodes_are_told_which_images_deployments_run_on_and_which_was_dropped(
    tmp_path: Path,
) -> None:
    env = make_env(tmp_path)
    second = env.cluster.register_worker(hello(name="node-2"))
    image = ember.Image.debian_slim().run_commands("true")
    env.cluster.collect_garbage()
    assert env.commands() == [] and env.commands(second) == []  # no image deployed: quiet
    env.deploy(image=image.to_dict())
    env.cluster.collect_garbage()
    told = {"type": "images_in_use", "digests": [image.digest]}
    assert env.commands() == [told] and env.commands(second) == [told]
    env.cluster.collect_garbage()
    assert env.commands() == []  # told once, until it changes
    third = env.cluster.register_worker(hello(name="node-3"))
    assert env.commands(third) == [told] and env.commands() == []  # a node that joins
    env.cluster.deployments.remove_app(APP)
    env.cluster.collect_garbage()
    assert env.commands(second) == [{"type": "images_in_use"}]  # none (empty: omitted)
    env.cluster.image_copies.forget(image.digest)  # ember image rm
    assert env.commands(third) == [
        {"type": "images_in_use"},
        {"type": "forget_image", "digest": image.digest},
    ]
