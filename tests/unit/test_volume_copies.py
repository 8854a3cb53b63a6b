"""The node's volume copies within their disk budget: least recently synced first, never
a copy whose app has a replica on the node or whose lock a replica holds."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ember_worker.agent.volume_copies import collect_garbage, list_copies

MB = 1024 * 1024


def make_copy(root: Path, app: str, volume: str, size: int, synced_at: float | None) -> Path:
    folder = root / app / volume
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "data.bin").write_bytes(os.urandom(size))
    if synced_at is not None:
        state = root / app / f".{volume}.state.json"
        state.write_text("{}")
        os.utime(state, (synced_at, synced_at))
    return folder


def test_copies_are_listed_with_what_they_hold_on_disk(tmp_path: Path) -> None:
    make_copy(tmp_path, "shop", "images", MB, synced_at=100.0)
    (tmp_path / "shop" / ".images.lock").touch()
    (tmp_path / "stray-file").write_text("not an app folder")
    (copy,) = list_copies(tmp_path)
    assert (copy.app, copy.volume, copy.last_synced) == ("shop", "images", 100.0)
    assert MB <= copy.disk_bytes < MB + 64 * 1024
    assert list_copies(tmp_path / "missing") == []


def test_the_least_recently_synced_go_first_until_the_rest_fit(tmp_path: Path) -> None:
    oldest = make_copy(tmp_path, "a", "old", MB, synced_at=100.0)
    middle = make_copy(tmp_path, "b", "mid", MB, synced_at=200.0)
    newest = make_copy(tmp_path, "c", "new", MB, synced_at=300.0)
    removed = collect_garbage(tmp_path, int(1.5 * MB), lambda app: False)
    assert [(c.app, c.volume) for c in removed] == [("a", "old"), ("b", "mid")]
    assert not oldest.exists() and not middle.exists() and newest.exists()
    assert not (tmp_path / "a" / ".old.state.json").exists()  # no record of what is gone
    assert (tmp_path / "a" / ".old.lock").exists()  # every process keeps locking one file
    assert collect_garbage(tmp_path, int(1.5 * MB), lambda app: False) == []


def test_nothing_goes_while_the_copies_fit(tmp_path: Path) -> None:
    make_copy(tmp_path, "a", "one", MB, synced_at=100.0)
    assert collect_garbage(tmp_path, 2 * MB, lambda app: False) == []
    assert (tmp_path / "a" / "one" / "sub" / "data.bin").exists()


def test_copies_in_use_stay_and_the_next_one_goes_instead(tmp_path: Path) -> None:
    in_use = make_copy(tmp_path, "busy", "v", MB, synced_at=100.0)
    locked = make_copy(tmp_path, "syncing", "v", MB, synced_at=150.0)
    idle = make_copy(tmp_path, "idle", "v", MB, synced_at=200.0)
    asked: list[str] = []

    def busy(app: str) -> bool:
        asked.append(app)
        return app == "busy"

    with (tmp_path / "syncing" / ".v.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a replica in the middle of a reload
        removed = collect_garbage(tmp_path, MB, busy)
    assert [c.app for c in removed] == ["idle"]
    assert in_use.exists() and locked.exists() and not idle.exists()
    assert asked == ["busy", "idle"]  # asked under the lock, not for the locked one


def test_a_copy_never_synced_to_the_end_counts_as_old_as_its_folder(tmp_path: Path) -> None:
    unsynced = make_copy(tmp_path, "a", "partial", MB, synced_at=None)
    os.utime(unsynced, (50.0, 50.0))
    make_copy(tmp_path, "b", "whole", MB, synced_at=100.0)
    removed = collect_garbage(tmp_path, int(1.5 * MB), lambda app: False)
    assert [c.volume for c in removed] == ["partial"]


def test_what_a_crashed_reload_left_incoming_counts_and_goes_with_its_copy(
    tmp_path: Path,
) -> None:
    make_copy(tmp_path, "a", "old", MB, synced_at=100.0)
    incoming = tmp_path / "a" / ".old.incoming"
    incoming.mkdir()
    (incoming / "half.bin").write_bytes(os.urandom(MB))
    (copy,) = list_copies(tmp_path)
    assert copy.disk_bytes >= 2 * MB  # the half-fetched files take disk too
    assert collect_garbage(tmp_path, MB, lambda app: False) == [copy]
    assert not incoming.exists()
