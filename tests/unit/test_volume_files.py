"""Volume paths, and the state store's record of a volume's files."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_backends import StoreOpener

from ember.errors import InvalidError
from ember.state.volume_paths import check_volume_path, check_volume_prefix, parents
from ember_platform.storage.records import VolumeFile


@pytest.mark.parametrize(
    ("given", "stored"),
    [("a.txt", "a.txt"), ("/a/b/c.bin", "a/b/c.bin"), ("dir/", "dir"), ("é ü/x y", "é ü/x y")],
)
def test_paths_are_stored_relative_without_outer_slashes(given: str, stored: str) -> None:
    assert check_volume_path(given) == stored


@pytest.mark.parametrize(
    "path", ["", "/", "a//b", "../x", "a/./b", "a/..", "tab\there", "x" * 256, "a/" * 600]
)
def test_paths_that_could_mean_another_place_are_refused(path: str) -> None:
    with pytest.raises(InvalidError, match="not allowed"):
        check_volume_path(path)


def test_prefixes_and_parents() -> None:
    assert check_volume_prefix("") == "" and check_volume_prefix("/") == ""
    assert check_volume_prefix("/runs/") == "runs"
    assert parents("a/b/c") == ["a", "a/b"] and parents("a") == []


def _file(path: str, digest: str = "sha256:1", size: int = 1) -> VolumeFile:
    return VolumeFile(path, digest, size, 0.0)


def test_the_store_lists_a_folder_by_prefix_not_by_leading_text(open_store: StoreOpener) -> None:
    store = open_store()
    for path in ("ab/c", "a/b", "a/c/d", "a"):
        store.volume_put_file("app", "v", _file(path))
    store.volume_put_file("app", "other", _file("a/b"))
    assert [f.path for f in store.volume_files("app", "v")] == ["a", "a/b", "a/c/d", "ab/c"]
    assert [f.path for f in store.volume_files("app", "v", "a")] == ["a", "a/b", "a/c/d"]
    assert [f.path for f in store.volume_files("app", "v", "a/c")] == ["a/c/d"]
    assert store.volume_files("app", "v", "a/c/d/e") == []


def test_the_store_counts_volumes_and_knows_which_contents_are_in_use(
    open_store: StoreOpener,
) -> None:
    store = open_store()
    store.volume_put_file("app", "v", _file("x", "sha256:aa", 10))
    store.volume_put_file("app", "v", _file("y", "sha256:bb", 5))
    store.volume_put_file("app", "w", _file("x", "sha256:aa", 10))
    assert store.volumes("app") == [("v", 2, 15), ("w", 1, 10)]
    store.volume_put_file("app", "v", _file("x", "sha256:cc", 3))  # a new version of x
    assert store.volume_file("app", "v", "x") == _file("x", "sha256:cc", 3)
    assert store.volume_digest_used("sha256:aa")  # still w's
    store.volume_remove("app", "w", ["x"])
    assert not store.volume_digest_used("sha256:aa")
    assert store.volumes("app") == [("v", 2, 8)] and store.volumes("nobody") == []


def test_a_restore_makes_volumes_bring_their_copies_up_to_date_again(tmp_path: Path) -> None:
    from ember.config import ClientConfig
    from ember.state.volumes import Volume, forget_local_copies

    given = ClientConfig("https://cp:1", "tok", None, None)
    volumes = [Volume("a", app="app", config=given), Volume("b", app="app")]
    for volume in volumes:
        volume._synced_into = tmp_path  # synced before the snapshot
    forget_local_copies()
    assert [v._synced_into for v in volumes] == [None, None]


def test_paths_may_be_path_objects_but_not_other_things() -> None:
    from pathlib import PurePosixPath

    assert check_volume_path(PurePosixPath("a/b.txt")) == "a/b.txt"
    assert check_volume_prefix(Path("runs")) == "runs"
    with pytest.raises(InvalidError, match="a string or a path, not int"):
        check_volume_path(5)  # type: ignore[arg-type]


def test_an_upload_puts_a_file_into_a_remote_folder_named_with_a_slash(tmp_path: Path) -> None:
    from ember.state.volumes import upload_plan

    (tmp_path / "up").mkdir()
    file = tmp_path / "up" / "a.txt"
    file.write_text("a")
    assert upload_plan(file) == [(file, "a.txt")]
    assert upload_plan(file, "dest") == [(file, "dest")]
    assert upload_plan(file, "dest/") == [(file, "dest/a.txt")]
    assert upload_plan(file, "/") == [(file, "a.txt")]
    assert upload_plan(tmp_path / "up", "dest/") == [(file, "dest/a.txt")]
