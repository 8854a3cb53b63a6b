"""The node's cache of snapshot images: least recently used images go past its budget."""

from __future__ import annotations

import os
from pathlib import Path

from ember_worker.snapshots.node_cache import image_name
from ember_worker.snapshots.snapshotter import Snapshotter
from ember_worker.snapshots.support import SnapshotSupport


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
    assert not cache.has("a" * 64, "")  # no metadata: not a whole image
    (held / "images" / "meta.json").write_text("{}")
    assert cache.has("a" * 64, "") and not cache.has("b" * 64, "")
    assert cache.room_for(1400)  # 1002 + 1400 <= 2500: nothing would be evicted
    assert not cache.room_for(1600)


def test_a_huge_page_view_of_an_image_costs_no_more_room(tmp_path: Path) -> None:
    cache = snapshotter(tmp_path, budget=2500)
    folder = image(tmp_path, "a" * 64, 1000, 100)
    view = folder / "images-huge"  # huge_pages.py: its files are hard links
    view.mkdir()
    os.link(folder / "images" / "pages-1.img", view / "pages-1.img")
    (view / "mm-1.img").write_bytes(b"\0" * 100)  # its own copy of the memory map
    assert cache.room_for(1400) and not cache.room_for(1401)  # 1100 held, not 2100


def whole_image(root: Path, key: str, image_id: str) -> Path:
    folder = image(root, image_name(key, image_id), 10, 100)
    (folder / "images" / "meta.json").write_text("{}")
    return folder


def test_each_dump_of_a_key_is_an_image_of_its_own(tmp_path: Path) -> None:
    cache = snapshotter(tmp_path, budget=10_000)
    key = "a" * 32
    whole_image(tmp_path, key, "0ld")
    # The key was dropped and taken again: the node's old image is not the new one.
    assert cache.has(key, "0ld") and not cache.has(key, "n3w")
    whole_image(tmp_path, key, "n3w")
    whole_image(tmp_path, "b" * 32, "")  # from before image ids: the key alone
    (tmp_path / ".fetch-x").mkdir()
    assert cache.cached() == [(key, "0ld"), (key, "n3w"), ("b" * 32, "")]
    cache.forget(key, "0ld")
    assert cache.cached() == [(key, "n3w"), ("b" * 32, "")]


def test_a_dropped_key_goes_from_the_node_except_an_image_being_read(tmp_path: Path) -> None:
    cache = snapshotter(tmp_path, budget=10_000)
    key = "a" * 32
    read = whole_image(tmp_path, key, "1")
    whole_image(tmp_path, key, "2")
    whole_image(tmp_path, key, "")
    other = whole_image(tmp_path, "c" * 32, "3")
    cache.in_use[read.name] = 1  # a restore reads it now: the cache's collection takes it later
    assert sorted(cache.forget_key(key)) == [key, image_name(key, "2")]
    assert read.exists() and other.exists()


def test_work_folders_a_killed_worker_left_go_when_the_next_one_starts(tmp_path: Path) -> None:
    kept = image(tmp_path, image_name("k" * 32, None), 10, used_at=100.0)
    for prefix in (".fetch-abc-", ".take-abc-", ".publish-abc-", ".restore-"):
        left = tmp_path / f"{prefix}x1"
        left.mkdir()
        (left / "image.tar.zst").write_bytes(b"\0" * 1000)
    snapshotter(tmp_path, budget=10**9)
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name]
