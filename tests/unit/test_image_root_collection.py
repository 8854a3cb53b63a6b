"""Collection of a node's image roots (worker/ember_worker/images/root_collection.py):
the policy (unwanted or dropped first, then the least recently used past the budget,
never one a replica uses), the collector removing extracted roots and lazy mounts'
folders made by the test under a worker's images folder, and a builder's unpacked
layers kept within their budget."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import ember
from ember_worker.images.builder import ImageBuilder
from ember_worker.images.image_roots import NodeRoot
from ember_worker.images.layer_store import LayerStore
from ember_worker.images.lazy.lazy_roots import LazyImageRoots
from ember_worker.images.root_collection import ImageRootCollector, roots_to_remove

GB = 10**9


def _digest(char: str) -> str:
    return "sha256:" + char * 64


A, B, C, D = (_digest(c) for c in "abcd")


def test_unwanted_and_dropped_go_then_the_least_recently_used_past_the_budget() -> None:
    roots = [
        NodeRoot(A, "extracted", 4 * GB, used_at=10.0),
        NodeRoot(B, "extracted", 4 * GB, used_at=30.0),
        NodeRoot(C, "extracted", 4 * GB, used_at=20.0),
        NodeRoot(D, "lazy", 0, used_at=0.0),
    ]
    everything = {A, B, C, D}
    assert roots_to_remove(roots, in_use=set(), wanted=None, budget_bytes=20 * GB) == []
    # Not told yet which images are wanted: only the budget (C before B: older use).
    assert roots_to_remove(roots, in_use={A}, wanted=None, budget_bytes=5 * GB) == [C, B]
    # Unwanted ones first, mounts included; the budget counts what stays.
    assert roots_to_remove(roots, in_use=set(), wanted={B, C}, budget_bytes=5 * GB) == [A, D, C]
    assert roots_to_remove(
        roots, in_use=set(), wanted=everything, dropped={B}, budget_bytes=9 * GB
    ) == [B]
    # A root a replica uses stays, whatever else.
    assert roots_to_remove(roots, in_use=everything, wanted=set(), budget_bytes=0) == []
    # A mount costs the disk nothing: never removed for the budget.
    assert roots_to_remove(roots, in_use={A, B, C}, wanted=None, budget_bytes=0) == []
    # An image with both a mount and an extracted root counts once, both sizes.
    both = [*roots, NodeRoot(C, "lazy", 0, 0.0)]
    assert roots_to_remove(both, in_use=set(), wanted={A}, budget_bytes=99 * GB) == [B, C, D]


def _extracted(folder: Path, digest: str, size: int | None, used_at: float) -> Path:
    root = folder / "roots" / digest.removeprefix("sha256:")
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "python3.11").write_bytes(b"x" * 1000)
    if size is not None:
        sidecar = root.with_name(root.name + ".json")
        sidecar.write_text(json.dumps({"size": size}))
        os.utime(sidecar, (used_at, used_at))
    return root


def test_the_collector_removes_extracted_roots_and_mounts_no_replica_uses(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LayerStore("https://127.0.0.1:9", "token", None)
        roots = LazyImageRoots(store, tmp_path, None)
        a = _extracted(tmp_path, A, 3 * GB, used_at=100.0)
        b = _extracted(tmp_path, B, 3 * GB, used_at=200.0)
        c = _extracted(tmp_path, C, None, used_at=0.0)  # an older worker's: no sidecar
        mount = tmp_path / "image-mounts" / D.removeprefix("sha256:")
        mount.mkdir(parents=True)  # a mount whose process is gone (none here)
        (mount.parent / (mount.name + ".stats")).write_text("{}")
        (mount.parent / (mount.name + ".log")).write_text("")
        (tmp_path / "roots" / ".partial-abc").mkdir()  # an extraction cut short
        present = {(r.digest, r.how, r.size) for r in roots.present()}
        assert present == {
            (A, "extracted", 3 * GB),
            (B, "extracted", 3 * GB),
            (C, "extracted", 1000),  # measured
            (D, "lazy", 0),
        }
        in_use = {A}
        collector = ImageRootCollector(roots, 4 * GB, lambda: set(in_use))
        # Not told what is wanted: the budget alone. A (in use) stays; C, whose last use
        # is not known, goes first, then B.
        assert await collector.collect() == [C, B]
        assert a.is_dir() and not b.exists() and not c.exists() and mount.is_dir()
        assert not (tmp_path / "roots" / (b.name + ".json")).exists()
        collector.told([A])  # what deployments run on: the mount's image is not
        await asyncio.gather(*collector._tasks)
        assert a.is_dir() and not mount.exists()
        assert not (mount.parent / (mount.name + ".stats")).exists()
        collector.forget(A)  # `ember image rm`: kept while its replica runs
        await asyncio.gather(*collector._tasks)
        assert a.is_dir() and collector.dropped == {A}
        in_use.clear()  # its replica ended
        collector.collect_soon()
        await asyncio.gather(*collector._tasks)
        assert not a.exists() and collector.dropped == set()
        assert os.listdir(tmp_path / "roots") == [".partial-abc"]  # the worker's start cleans it
        roots.extracted.clean_partial()
        assert os.listdir(tmp_path / "roots") == []

    asyncio.run(scenario())


def test_a_builders_unpacked_layers_are_kept_within_the_budget(tmp_path: Path) -> None:
    store = LayerStore("https://127.0.0.1:9", "token", None)
    builder = ImageBuilder(store, tmp_path)
    image = ember.Image.debian_slim().run_commands("true").run_commands("echo")
    hexes = [layer.digest.removeprefix("sha256:") for layer in image.layers]
    for at, hex_digest in enumerate(hexes, start=1):
        (builder.layers / hex_digest / "usr").mkdir(parents=True)
        marker = builder.layers / f"{hex_digest}.json"
        marker.write_text(json.dumps({"sha256": "0" * 64, "size": 2 * GB, "kind": "run"}))
        os.utime(marker, (at, at))
    (builder.layers / ("f" * 64)).mkdir()  # an unpacking cut short: no marker
    assert builder.local(image.layers[0]) == builder.layers / hexes[0]  # used now
    assert builder.trim(4 * GB) == [hexes[1]]  # the least recently used
    assert sorted(p.name for p in builder.layers.iterdir()) == sorted(
        [hexes[0], hexes[0] + ".json", hexes[2], hexes[2] + ".json"]
    )
    assert builder.trim(0) == [hexes[2], hexes[0]]
    assert list(builder.layers.iterdir()) == []
