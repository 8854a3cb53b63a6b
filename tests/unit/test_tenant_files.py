"""The agent's walks and opens in trees a tenant writes follow no link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from machine_needs import need

from ember_worker.processes import tenant_files


def test_open_regular_reads_a_file_beneath_and_refuses_links_and_fifos(tmp_path: Path) -> None:
    (tmp_path / "area" / "d").mkdir(parents=True)
    (tmp_path / "area" / "d" / "f").write_text("own")
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "f").write_text("node's")
    fd = tenant_files.open_regular(tmp_path / "area", "d/f")
    with open(fd) as handle:
        assert handle.read() == "own"
    (tmp_path / "area" / "d").rename(tmp_path / "area" / "was")
    (tmp_path / "area" / "d").symlink_to(tmp_path / "node")  # a folder swapped for a link
    (tmp_path / "area" / "last").symlink_to(tmp_path / "node" / "f")
    os.mkfifo(tmp_path / "area" / "fifo")
    for relative in ("d/f", "last", "fifo", "../node/f"):
        with pytest.raises(OSError):
            tenant_files.open_regular(tmp_path / "area", relative)


def test_chown_tree_hands_over_links_themselves_never_their_targets(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        need("root", "chown_tree hands a tree to another uid: that needs root")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("node's")
    top = tmp_path / "top"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("own")
    (top / "a" / "file-link").symlink_to(outside / "f")
    (top / "folder-link").symlink_to(outside)
    os.chmod(top / "a", 0o700)
    tenant_files.chown_tree(top, 4321, 4321)
    for path in (top, top / "a", top / "a" / "b", top / "a" / "b" / "f"):
        assert (path.stat().st_uid, path.stat().st_gid) == (4321, 4321), path
    for link in (top / "a" / "file-link", top / "folder-link"):
        assert os.lstat(link).st_uid == 4321
    assert outside.stat().st_uid == os.geteuid() and (outside / "f").stat().st_uid == os.geteuid()
