"""An image's file index (worker/ember_worker/images/lazy/file_index.py): layers
flattened with their whiteouts, opaque folders, hard and symbolic links, owners and
modes; each file's bytes found at its offset in its layer tar; chunk digests; the
serialized form read back the same; compressed or damaged layers refused."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
from pathlib import Path

import pytest
from small_images import E, layer_tar

from ember_worker.images.lazy.file_index import FileIndex, UnindexableImage, index_layers


def index_of(folder: Path, shas: list[str], chunk_bytes: int = 64 * 1024) -> FileIndex:
    return index_layers(
        [(sha, io.BytesIO((folder / sha).read_bytes())) for sha in shas], chunk_bytes
    )


def bytes_of(folder: Path, index: FileIndex, path: str) -> bytes:
    node = index.lookup(path)
    assert node is not None and node.kind == "file"
    raw = (folder / index.sources[node.source].sha256).read_bytes()
    return raw[node.offset : node.offset + node.size]


def test_layers_flatten_with_whiteouts_opaque_folders_and_links(tmp_path: Path) -> None:
    big = os.urandom(200_000)
    lower = layer_tar(
        tmp_path,
        [
            E("d", "etc", mode=0o755),
            E("f", "etc/keep", b"kept\n"),
            E("f", "etc/gone", b"x"),
            E("d", "var/cache", mode=0o755),
            E("f", "var/cache/old", b"old"),
            E("f", "usr/lib/big.so", big, mode=0o755),
            E("h", "usr/lib/big-again.so", link="usr/lib/big.so"),
            E("l", "lib", link="usr/lib", mode=0o777),
            E("f", "home/user/secret", b"s", mode=0o600, uid=1000, gid=1000),
            E("c", "dev/null", mode=0o666),
        ],
    )
    upper = layer_tar(
        tmp_path,
        [
            E("f", "etc/.wh.gone"),
            E("f", "var/cache/.wh..wh..opq"),
            E("f", "var/cache/new", b"new"),
            E("f", "etc/keep", b"replaced\n", mode=0o640),
            E("f", "usr/bin/tool", b"#!/bin/sh\n", mode=0o4755),
        ],
    )
    index = index_of(tmp_path, [lower, upper])
    assert index.lookup("etc/gone") is None  # whited out
    assert sorted(index.lookup("var/cache").children) == ["new"]  # type: ignore[union-attr]
    assert bytes_of(tmp_path, index, "etc/keep") == b"replaced\n"
    assert index.lookup("/etc/keep").mode == 0o640  # type: ignore[union-attr]
    assert bytes_of(tmp_path, index, "usr/lib/big.so") == big
    one, two = index.lookup("usr/lib/big.so"), index.lookup("usr/lib/big-again.so")
    assert one is two and one is not None and one.nlink == 2  # a hard link: one inode
    link = index.lookup("lib")
    assert link is not None and link.kind == "link" and link.target == "usr/lib"
    secret = index.lookup("home/user/secret")
    assert secret is not None and (secret.mode, secret.uid, secret.gid) == (0o600, 1000, 1000)
    assert index.lookup("usr/bin/tool").mode == 0o4755  # type: ignore[union-attr]
    device = index.lookup("dev/null")
    assert device is not None and device.kind == "char" and device.rdev == (1 << 8) | 3
    assert index.lookup("home").kind == "dir"  # type: ignore[union-attr]  # implied

    # Chunk digests cover each tar whole.
    raw = (tmp_path / lower).read_bytes()
    chunks = [raw[i : i + 64 * 1024] for i in range(0, len(raw), 64 * 1024)]
    assert list(index.sources[0].chunks) == [hashlib.sha256(c).digest() for c in chunks]

    again = FileIndex.from_bytes(index.to_bytes())
    assert bytes_of(tmp_path, again, "usr/lib/big.so") == big
    assert again.lookup("usr/lib/big.so") is again.lookup("usr/lib/big-again.so")
    assert again.lookup("usr/lib/big.so").nlink == 2  # type: ignore[union-attr]
    assert again.sources == index.sources
    assert [(i.kind, i.mode, i.size) for i in again.inodes] == [
        (i.kind, i.mode, i.size) for i in index.inodes
    ]


def test_a_file_replacing_a_folder_and_a_folder_replacing_a_link(tmp_path: Path) -> None:
    lower = layer_tar(tmp_path, [E("f", "opt/x/y", b"1"), E("l", "bin", link="usr/bin")])
    upper = layer_tar(tmp_path, [E("f", "opt/x", b"2"), E("d", "bin", mode=0o755)])
    index = index_of(tmp_path, [lower, upper])
    assert bytes_of(tmp_path, index, "opt/x") == b"2"
    assert index.lookup("bin").kind == "dir"  # type: ignore[union-attr]


def test_mount_points_are_added_where_the_image_lacks_them(tmp_path: Path) -> None:
    sha = layer_tar(tmp_path, [E("l", "etc/hosts", link="/nowhere"), E("f", "etc/keep", b"k")])
    index = index_of(tmp_path, [sha])
    index.add_mount_points(["etc/hosts", "etc/resolv.conf", "etc/keep"], ["/srv/app"])
    hosts, keep = index.lookup("etc/hosts"), index.lookup("etc/keep")
    assert hosts is not None and hosts.kind == "file" and hosts.size == 0
    assert keep is not None and keep.size == 1  # kept as it is
    assert index.lookup("etc/resolv.conf").kind == "file"  # type: ignore[union-attr]
    assert index.lookup("srv/app").kind == "dir"  # type: ignore[union-attr]
    assert hosts in index.inodes


def test_compressed_damaged_or_escaping_layers_are_refused(tmp_path: Path) -> None:
    sha = layer_tar(tmp_path, [E("f", "a", b"a")])
    squeezed = gzip.compress((tmp_path / sha).read_bytes())
    with pytest.raises(UnindexableImage, match="compressed"):
        index_layers([(hashlib.sha256(squeezed).hexdigest(), io.BytesIO(squeezed))])
    with pytest.raises(UnindexableImage, match="another sha256"):
        index_layers([("0" * 64, io.BytesIO((tmp_path / sha).read_bytes()))])
    out = layer_tar(tmp_path, [E("f", "../../escaped", b"x")])
    with pytest.raises(UnindexableImage, match="leads out"):
        index_of(tmp_path, [out])
