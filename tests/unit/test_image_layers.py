"""OCI layers to and from overlayfs folders (whiteouts, opaque folders), the refusals
that keep a layer's entries inside its folder, a registry image's layers applied in
order, the Debian mirror read from apt's sources in both formats, and the account the
rootless base is built as."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
from machine_needs import need

from ember_worker.images.debian_base import (
    BaseImageError,
    base_account,
    node_mirror,
    subordinate_ids,
)
from ember_worker.images.image_roots import ImageConfig, ImageRootError, prepare_mount_points
from ember_worker.images.oci_layers import (
    OPAQUE_XATTR,
    apply_layer,
    pack_upper,
    unpack_for_overlay,
)


@pytest.fixture(autouse=True)
def as_root() -> None:
    if os.geteuid() != 0:
        need("root", "whiteouts are device nodes and opaque folders trusted.* attributes")


def layer(path: Path, entries: list[tuple[str, str, str]]) -> Path:
    """A tar of (kind, name, data or link target) entries: f file, d folder, l symlink,
    h hard link."""
    with tarfile.open(path, "w") as tar:
        for kind, name, data in entries:
            info = tarfile.TarInfo(name)
            if kind == "d":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind in ("l", "h"):
                info.type = tarfile.SYMTYPE if kind == "l" else tarfile.LNKTYPE
                info.linkname = data
                tar.addfile(info)
            else:
                info.size = len(data.encode())
                tar.addfile(info, io.BytesIO(data.encode()))
    return path


def test_an_upper_folder_packs_to_whiteouts_and_unpacks_back(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc" / "new.conf").write_text("x")
    os.mknod(upper / "etc" / "gone.conf", stat.S_IFCHR, 0)  # deleted in this step
    (upper / "var" / "log").mkdir(parents=True)
    os.setxattr(upper / "var" / "log", OPAQUE_XATTR, b"y")  # replaced whole
    (upper / "usr").mkdir()
    (upper / "usr" / "tool").symlink_to("/usr/bin/elsewhere")
    archive = tmp_path / "layer.tar"
    assert pack_upper(upper, archive) == 8
    with tarfile.open(archive) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert {"etc/.wh.gone.conf", "var/log/.wh..wh..opq", "etc/new.conf"} <= set(names)
    assert names["etc/new.conf"].uname == "" and names["usr/tool"].linkname == "/usr/bin/elsewhere"

    lower = tmp_path / "lower"
    unpack_for_overlay(archive, lower)
    gone = (lower / "etc" / "gone.conf").lstat()
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert os.getxattr(lower / "var" / "log", OPAQUE_XATTR) == b"y"
    assert os.readlink(lower / "usr" / "tool") == "/usr/bin/elsewhere"  # absolute links kept
    assert not (lower / "etc" / ".wh.gone.conf").exists()


@pytest.mark.parametrize(
    "entries",
    [
        [("f", "../escaped", "x")],
        [("f", "/etc/escaped", "x")],
        [("l", "out", "/"), ("f", "out/escaped", "x")],  # through a link leading out
        [("h", "hard", "../../etc/passwd")],
        [("l", "link", "/tmp/victim"), ("f", "link", "x")],  # written through a link
        [("f", "sub/../../.wh.escaped", "")],
    ],
)
def test_entries_that_would_land_outside_the_layer_are_refused(
    tmp_path: Path, entries: list[tuple[str, str, str]]
) -> None:
    archive = layer(tmp_path / "bad.tar", entries)
    with pytest.raises(tarfile.OutsideDestinationError):
        unpack_for_overlay(archive, tmp_path / "target")
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/victim").exists()


def test_registry_layers_apply_in_order_with_their_whiteouts(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    first = layer(
        tmp_path / "1.tar",
        [
            ("d", "etc", ""),
            ("f", "etc/keep", "1"),
            ("f", "etc/drop", "1"),
            ("d", "cache", ""),
            ("f", "cache/old", "1"),
            ("l", "bin", "usr/bin"),
        ],
    )
    second = layer(
        tmp_path / "2.tar",
        [
            ("f", "etc/.wh.drop", ""),
            ("f", "cache/.wh..wh..opq", ""),
            ("f", "cache/new", "2"),
            ("d", "bin", ""),  # a folder where a link was
            ("f", "bin/sh", "2"),
        ],
    )
    apply_layer(first, tree)
    apply_layer(second, tree)
    assert (tree / "etc" / "keep").exists() and not (tree / "etc" / "drop").exists()
    assert sorted(p.name for p in (tree / "cache").iterdir()) == ["new"]
    assert not (tree / "bin").is_symlink() and (tree / "bin" / "sh").read_text() == "2"


def test_a_layers_device_nodes_are_never_made_on_the_node(tmp_path: Path) -> None:
    """A registry layer's block and character devices are left out, in the build's
    cache and in an extracted root alike (a sandbox mounts its own /dev)."""
    archive = tmp_path / "devices.tar"
    with tarfile.open(archive, "w") as tar:
        for name, kind in (("disk", tarfile.BLKTYPE), ("mem", tarfile.CHRTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.devmajor, info.devminor = kind, 0o666, 1, 1
            tar.addfile(info)
        fifo = tarfile.TarInfo("pipe")
        fifo.type = tarfile.FIFOTYPE
        tar.addfile(fifo)
    unpack_for_overlay(archive, tmp_path / "lower")
    apply_layer(archive, tmp_path / "tree")
    for folder in ("lower", "tree"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["pipe"]


def test_mount_points_are_made_inside_the_image_through_no_link(tmp_path: Path) -> None:
    """An image whose /etc is a link to a node folder is refused, and nothing is made
    in that folder; a working folder through a link is left alone, one missing made."""
    node = tmp_path / "node-etc"
    node.mkdir()
    (node / "resolv.conf").symlink_to("stub")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "etc").symlink_to(node)
    with pytest.raises(ImageRootError, match="/etc is not a folder"):
        prepare_mount_points(linked, ImageConfig("sha256:x", {}, "/"))
    assert (node / "resolv.conf").is_symlink() and not (node / "hosts").exists()

    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hosts").symlink_to(node / "hosts")
    (root / "app").symlink_to(node)
    prepare_mount_points(root, ImageConfig("sha256:x", {}, "/app/work"))
    assert (root / "etc" / "hosts").is_file() and not (root / "etc" / "hosts").is_symlink()
    assert (root / "etc" / "resolv.conf").is_file() and not (node / "work").exists()
    prepare_mount_points(root, ImageConfig("sha256:x", {}, "/srv/work"))
    assert (root / "srv" / "work").is_dir()


def test_the_mirror_comes_from_apt_sources_in_either_format(tmp_path: Path) -> None:
    one_line = tmp_path / "sources.list"
    one_line.write_text(
        "# deb http://commented.example/debian bookworm main\n"
        "deb http://security.mirror.example/debian-security bookworm-security main\n"
        "deb [arch=amd64] http://mirror.example/debian/ bookworm main\n"
    )
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    assert node_mirror(one_line, parts) == "http://mirror.example/debian"
    (parts / "debian.sources").write_text(
        "Types: deb\nURIs: http://other.example/debian\nSuites: bookworm\n"
    )
    assert node_mirror(tmp_path / "none", parts) == "http://other.example/debian"
    assert node_mirror(tmp_path / "none", tmp_path / "none.d") is None


def test_a_build_account_is_found_by_name_in_the_subordinate_id_table(tmp_path: Path) -> None:
    table = tmp_path / "subuid"
    table.write_text("someone:100000:65536\nember-build:400000:65536\nbroken:x:y\n")
    assert subordinate_ids("ember-build", table) == (400_000, 65_536)
    assert subordinate_ids("broken", table) is None
    assert subordinate_ids("nobody-here", table) is None
    assert subordinate_ids("ember-build", tmp_path / "missing") is None


def test_a_node_without_the_build_account_says_how_to_make_it() -> None:
    with pytest.raises(BaseImageError, match=r"infra/install\.sh") as caught:
        base_account("ember-no-such-account")
    assert "no account 'ember-no-such-account'" in str(caught.value)
