"""The node's weights caches, one per workspace (weights/cache/workspace_caches.py): the
node's budget over them all, evicted from the workspaces above an equal share first,
and an agent that follows no link a tenant planted in its cache."""

from __future__ import annotations

import os
from pathlib import Path

from ember_worker.weights.cache.workspace_caches import NodeWeights, uid_of, workspace_dir

MIB = 2**20


def _object(cache: Path, key: str, size: int, used_at: float, url: str = "") -> Path:
    objects = cache / "objects"
    (objects / f"{key}.chunks").mkdir(parents=True, exist_ok=True)
    (objects / f"{key}.chunks" / f"0-{size}").touch()
    data = objects / f"{key}.data"
    data.write_bytes(b"w" * size)  # allocated, not sparse: it counts
    os.utime(data, (used_at, used_at))
    (objects / f"{key}.url").write_text(url or f"s3://b/{key}")
    return data


def test_the_budget_holds_for_all_workspaces_and_the_greedy_one_gives_up_its_own(
    tmp_path: Path,
) -> None:
    calm, greedy = workspace_dir(tmp_path, 201), workspace_dir(tmp_path, 202)
    calm_old = _object(calm, "a" * 64, MIB, used_at=1)  # the oldest of all
    greedy_files = [_object(greedy, str(i) * 64, MIB, used_at=10 + i) for i in range(4)]
    node = NodeWeights(tmp_path, 4 * MIB)
    assert node.usage() >= 5 * MIB
    freed = node.enforce()
    assert freed >= MIB and node.usage() <= 4 * MIB
    # LRU across the node would take the calm workspace's file; the greedy one, far over
    # its share (2 MiB), gives up its own oldest instead.
    assert calm_old.exists()
    assert not greedy_files[0].exists() and greedy_files[-1].exists()
    assert not greedy_files[0].with_suffix(".chunks").exists()
    assert not greedy_files[0].with_suffix(".url").exists()
    assert node.holdings() == {
        **{f"s3://b/{'a' * 64}": calm_old.stat().st_blocks * 512},
        **{f"s3://b/{f.stem}": f.stat().st_blocks * 512 for f in greedy_files[1:]},
    }


def test_links_a_tenant_plants_in_its_cache_are_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("the node's")
    cache = workspace_dir(tmp_path / "weights", 203)
    objects = cache / "objects"
    objects.mkdir(parents=True)
    (objects / f"{'b' * 64}.data").symlink_to(secret)  # counted, read or removed: never
    real = _object(cache, "c" * 64, MIB, used_at=5)
    planted = _object(cache, "d" * 64, MIB, used_at=6)
    planted.with_suffix(".url").unlink()
    planted.with_suffix(".url").symlink_to(secret)  # its URL: the node's secret
    other = workspace_dir(tmp_path / "weights", 204)
    other.mkdir()
    (other / "objects").symlink_to(objects)  # another workspace's objects, by a link
    node = NodeWeights(tmp_path / "weights", 0)
    assert node.holdings() == {f"s3://b/{'c' * 64}": real.stat().st_blocks * 512}
    node.enforce()
    assert secret.read_text() == "the node's"
    assert not real.exists() and not planted.exists()  # the regular objects went
    assert (objects / f"{'b' * 64}.data").is_symlink()


def test_an_image_path_names_its_workspace() -> None:
    assert uid_of("/w/weights/uid-201003/objects/abc.data") == 201003
    assert uid_of("/w/weights/objects/abc.data") is None
