"""Files a snapshot carries because another node may lack them (worker/side_files.py)."""

from __future__ import annotations

import io
import mmap
import os
import tarfile
from pathlib import Path

import pytest

from ember_worker.snapshots import side_files


def test_what_a_process_maps_or_holds_open_is_found(tmp_path: Path) -> None:
    mapped, held = tmp_path / "kernel.so", tmp_path / "scratch.txt"
    mapped.write_bytes(b"k" * 4096)
    held.write_text("x")
    with mapped.open("rb") as m, held.open("a"):
        view = mmap.mmap(m.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            found = side_files.used_files(side_files.process_tree(os.getpid()))
        finally:
            view.close()
    assert {str(mapped), str(held)} <= found
    # The interpreter's own files are there too, but under a stable root: not carried.
    roots = side_files.stable_roots([tmp_path / "worker"])
    carried = side_files.to_carry(found, roots)
    assert mapped in carried and held in carried
    assert not any(p.is_relative_to(Path("/usr")) for p in carried)


def test_files_under_stable_roots_or_not_regular_are_left_out(tmp_path: Path) -> None:
    worker = tmp_path / "worker"
    (worker / "bundles").mkdir(parents=True)
    inside, outside = worker / "bundles" / "code.so", tmp_path / "cache.so"
    inside.write_bytes(b"a")
    outside.write_bytes(b"b")
    roots = side_files.stable_roots([worker])
    paths = [str(inside), str(outside), str(tmp_path), str(tmp_path / "gone"), "/dev/null"]
    assert side_files.to_carry(paths, roots) == [outside]


def test_pack_and_put_back_what_is_missing(tmp_path: Path) -> None:
    images, files = tmp_path / "images", tmp_path / "cache"
    images.mkdir()
    (files / "sub").mkdir(parents=True)
    kernel, other, big = files / "sub" / "a.so", files / "b.so", files / "big.bin"
    kernel.write_bytes(b"small")
    other.write_bytes(b"other")
    big.write_bytes(b"x" * 100)
    kernel.chmod(0o755)
    packed = side_files.pack([kernel, other, big], images, limit=50)
    assert (packed.files, packed.bytes, packed.skipped) == (2, 10, [str(big)])
    assert side_files.put_back(images) == []  # this node has them all
    # Another node: the folder is missing; a file present but changed is left alone.
    kernel.unlink()
    kernel.parent.rmdir()
    other.write_bytes(b"changed, longer")
    assert side_files.put_back(images) == [str(kernel)]
    assert kernel.read_bytes() == b"small" and kernel.stat().st_mode & 0o777 == 0o755
    assert other.read_bytes() == b"changed, longer"
    assert not list(kernel.parent.glob(".*"))  # no temporary file left behind


def test_nothing_to_carry_writes_no_archive(tmp_path: Path) -> None:
    side_files.pack([], tmp_path)
    assert not (tmp_path / side_files.ARCHIVE).exists()
    assert side_files.put_back(tmp_path) == []


@pytest.mark.parametrize("name", ["../escape", "tmp/../../etc/x"])
def test_an_archive_that_points_outside_is_refused(tmp_path: Path, name: str) -> None:
    with tarfile.open(tmp_path / side_files.ARCHIVE, "w") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError, match="unexpected entry"):
        side_files.put_back(tmp_path)
