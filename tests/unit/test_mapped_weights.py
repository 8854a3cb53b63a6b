"""Weights files a snapshot maps instead of holding (worker/mapped_weights.py): which are
recorded, and which nodes may restore it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_worker.snapshots.mapped_weights import WeightsNotOnNode, check_on_node, find, total_bytes
from ember_worker.weights.cache.disk_object import missing_bytes


def _cache_file(objects: Path, name: str, size: int, markers: list[str]) -> Path:
    objects.mkdir(parents=True, exist_ok=True)
    data = objects / f"{name}.data"
    with data.open("wb") as handle:
        handle.truncate(size)
    (objects / f"{name}.chunks").mkdir(exist_ok=True)
    for marker in markers:
        (objects / f"{name}.chunks" / marker).touch()
    return data


def test_missing_bytes_merges_markers_of_any_size(tmp_path: Path) -> None:
    data = _cache_file(tmp_path, "a", 100, ["0-40", "30-60", "80-100", "junk", ".tmp-1"])
    assert missing_bytes(data, 100) == 20  # 60-80
    (tmp_path / "a.chunks" / "60-80").touch()
    assert missing_bytes(data, 100) == 0
    assert missing_bytes(tmp_path / "never.data", 7) == 7


def test_only_the_caches_data_files_are_recorded(tmp_path: Path) -> None:
    objects = tmp_path / "weights" / "objects"
    model = _cache_file(objects, "m", 1000, [])
    (objects / "m.url").write_text("s3://b/m")
    elsewhere = tmp_path / "model.data"
    elsewhere.write_bytes(b"x")
    paths = [str(model), str(objects / "m.url"), str(elsewhere), str(objects / "gone.data")]
    mapped = find(paths, objects)
    assert mapped == [{"path": str(model), "size": 1000}]
    assert total_bytes(mapped) == 1000


def test_a_whole_file_of_the_same_size_may_be_restored_from(tmp_path: Path) -> None:
    objects = tmp_path / "objects"
    model = _cache_file(objects, "m", 100, ["0-50", "50-100"])
    check_on_node([{"path": str(model), "size": 100}], objects)
    check_on_node([], objects)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("partial", "lacks 0.0 MB of m.data"),
        ("missing", "does not hold (m.data)"),
        ("resized", "m.data is 90 bytes here, 100 in the image"),
    ],
)
def test_a_file_not_whole_on_the_node_declines_the_restore(
    tmp_path: Path, case: str, why: str
) -> None:
    objects = tmp_path / "objects"
    size = 90 if case == "resized" else 100
    markers = ["0-50"] if case == "partial" else ["0-100"]
    model = _cache_file(objects, "m", size, markers)
    if case == "missing":
        model.unlink()
    with pytest.raises(WeightsNotOnNode, match=why.replace("(", r"\(").replace(")", r"\)")):
        check_on_node([{"path": str(model), "size": 100}], objects)


def test_the_objects_behind_files_the_node_lacks_are_named_by_their_cache_keys(
    tmp_path: Path,
) -> None:
    from ember_worker.snapshots.mapped_weights import objects_to_fetch
    from ember_worker.weights.cache.disk_cache import DiskCache
    from ember_worker.weights.origins.origin import ObjectVersion

    objects = tmp_path / "objects"
    read = [
        {"url": "s3://b/whole", "s3_endpoint_url": None, "tag": '"1"'},
        {"url": "s3://b/partial", "s3_endpoint_url": "http://s3", "tag": '"2"'},
        {"url": "s3://b/gone", "s3_endpoint_url": None, "tag": '"3"'},
        {"url": "s3://b/not-mapped", "s3_endpoint_url": None, "tag": '"4"'},
    ]

    def name(entry: dict, size: int) -> str:
        return DiskCache.key(entry["url"], ObjectVersion(size=size, tag=entry["tag"]))

    whole = _cache_file(objects, name(read[0], 100), 100, ["0-100"])
    partial = _cache_file(objects, name(read[1], 200), 200, ["0-100"])
    gone = objects / f"{name(read[2], 300)}.data"
    mapped = [
        {"path": str(whole), "size": 100},
        {"path": str(partial), "size": 200},
        {"path": str(gone), "size": 300},
    ]
    wanted = objects_to_fetch(mapped, read, objects)
    assert wanted == [{**read[1], "size": 200}, {**read[2], "size": 300}]
    # Mapped from another node's folder: fetched here by its name all the same.
    elsewhere = {"path": str(tmp_path / "other" / gone.name), "size": 300}
    assert objects_to_fetch([elsewhere], read, objects) == [{**read[2], "size": 300}]
    # A tag other than the one read names another file: nothing to fetch for it.
    assert objects_to_fetch(mapped[:1], [{**read[0], "tag": '"9"'}], objects) == []


def test_a_file_mapped_from_another_folder_is_linked_there_for_the_restore(
    tmp_path: Path,
) -> None:
    from ember_worker.snapshots.mapped_weights import linked_in_place

    objects = tmp_path / "here" / "objects"
    model = _cache_file(objects, "m", 100, ["0-100"])
    there = tmp_path / "there" / "weights" / "objects" / "m.data"
    mapped = [{"path": str(there), "size": 100}, {"path": str(model), "size": 100}]
    check_on_node(mapped, objects)  # whole here, by its name
    with linked_in_place(mapped, objects):
        assert there.is_symlink() and there.samefile(model)
        assert there.read_bytes() == bytes(100)
    assert not there.exists() and not there.is_symlink()  # only for the restore
    assert not (tmp_path / "there").exists()  # nor the folders made for it
    assert model.exists()
    # A link left there by a restore cut off is replaced; a real file is not touched.
    there.parent.mkdir(parents=True)
    there.symlink_to(tmp_path / "gone.data")
    with linked_in_place(mapped, objects):
        assert there.samefile(model)
    _cache_file(there.parent, "m", 100, ["0-100"]).unlink()  # another cache's markers
    there.write_bytes(bytes(100))  # and its whole copy: mapped as it is
    with linked_in_place(mapped, objects):
        assert not there.is_symlink() and there.read_bytes() == bytes(100)
    there.write_bytes(b"someone else's")
    refused = pytest.raises(WeightsNotOnNode, match="which another file holds here")
    with refused, linked_in_place(mapped, objects):
        pass
    assert there.read_bytes() == b"someone else's"


def test_a_file_not_whole_here_under_its_name_declines_the_restore_from_elsewhere(
    tmp_path: Path,
) -> None:
    objects = tmp_path / "objects"
    _cache_file(objects, "m", 100, ["0-60"])
    there = tmp_path / "there" / "m.data"
    with pytest.raises(WeightsNotOnNode, match=r"lacks 0\.0 MB of m\.data"):
        check_on_node([{"path": str(there), "size": 100}], objects)
