"""The node's cache of snapshot images: least recently used images go past its budget."""

from __future__ import annotations

import os
from pathlib import Path

from ember_worker.snapshots import SnapshotSupport, Snapshotter


def snapshotter(root: Path, budget: int) -> Snapshotter:
    support = SnapshotSupport(None, "/usr/local/sbin/criu", "4.1.1", "env", True)
    return Snapshotter(support, root, "https://127.0.0.1:1", "token", None, budget)


def image(root: Path, key: str, size: int, used_at: float) -> Path:
    folder = root / key
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "pages-1.img").write_bytes(b"\0" * size)
    os.utime(folder, (used_at, used_at))
    return folder


def test_the_least_recently_used_images_go_until_the_cache_fits(tmp_path: Path) -> None:
    cache = snapshotter(tmp_path, budget=2500)
    oldest = image(tmp_path, "a" * 64, 1000, 100)
    in_use = image(tmp_path, "b" * 64, 1000, 200)
    newer = image(tmp_path, "c" * 64, 1000, 300)
    newest = image(tmp_path, "d" * 64, 1000, 400)
    (tmp_path / ".restore-x").mkdir()  # a restore's work dir: never an image
    cache.in_use[in_use.name] = 1  # a restore reads it now
    assert cache.collect_garbage() == [oldest.name, newer.name]
    assert in_use.exists() and newest.exists() and (tmp_path / ".restore-x").exists()
    assert cache.collect_garbage() == []  # it fits now: 2000 of 2500 bytes


def test_an_image_is_fetched_ahead_only_where_it_fits_beside_the_others(tmp_path: Path) -> None:
    cache = snapshotter(tmp_path, budget=2500)
    held = image(tmp_path, "a" * 64, 1000, 100)
    assert not cache.has("a" * 64)  # no metadata: not a whole image
    (held / "images" / "meta.json").write_text("{}")
    assert cache.has("a" * 64) and not cache.has("b" * 64)
    assert cache.room_for(1400)  # 1002 + 1400 <= 2500: nothing would be evicted
    assert not cache.room_for(1600)
