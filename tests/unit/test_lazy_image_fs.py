"""The lazy image file system, mounted for real (FUSE, the mount process of
worker/ember_worker/images/lazy/) over a small image made here, its layer tars in a
`file://` store: files, folders, symbolic and hard links, owners and modes as the index
says, missing names, no writes, bytes through the node's disk cache, and a damaged
chunk refused with EIO rather than served."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import io
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from machine_needs import need
from small_images import E, layer_tar

from ember_worker.images.lazy.file_index import index_layers

BIG = hashlib.sha256(b"seed").digest() * (3 * 1024 * 1024 // 32)  # 3 MiB: several chunks
DAMAGED = b"this file's chunk is damaged in the store\n"


def _mount(
    tmp: Path, store: Path, shas: list[str], lifeline: int | None = None
) -> tuple[Path, subprocess.Popen[bytes]]:
    index = index_layers([(sha, io.BytesIO((store / sha).read_bytes())) for sha in shas])
    (tmp / "index.zst").write_bytes(index.to_bytes())
    mountpoint = tmp / "root"
    mountpoint.mkdir()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember_worker.images.lazy.mount_process",
            "--index",
            str(tmp / "index.zst"),
            "--mountpoint",
            str(mountpoint),
            "--store",
            f"file://{store}",
            "--cache",
            str(tmp / "cache"),
            "--stats",
            str(tmp / "stats.json"),
            "--mount-file",
            "etc/resolv.conf",
            "--mount-dir",
            "/srv/app",
            *(["--lifeline", str(lifeline)] if lifeline is not None else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=() if lifeline is None else (lifeline,),
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.strip() == b"ready", process.stderr.read() if process.stderr else line
    return mountpoint, process


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    if os.geteuid() != 0:
        need("root", "mounting a FUSE file system for every user (allow_other)")
    if importlib.util.find_spec("pyfuse3") is None or not os.path.exists("/dev/fuse"):
        need("packages", "pyfuse3 and /dev/fuse (bash infra/install.sh)")
    tmp = tmp_path_factory.mktemp("lazy-fs")
    store = tmp / "store"
    lower = layer_tar(
        store,
        [
            E("d", "usr/bin", mode=0o755),
            E("f", "usr/bin/hello", b"#!/bin/sh\necho hello\n", mode=0o755),
            E("f", "usr/lib/big.bin", BIG),
            E("h", "usr/lib/big-link.bin", link="usr/lib/big.bin"),
            E("l", "lib", link="usr/lib", mode=0o777),
            E("f", "etc/gone", b"gone"),
            E("d", "home/user", mode=0o700, uid=1000, gid=1000),
            E("f", "home/user/secret", b"s", mode=0o600, uid=1000, gid=1000),
        ],
    )
    upper = layer_tar(store, [E("f", "etc/.wh.gone"), E("f", "etc/motd", b"welcome\n")])
    top = layer_tar(store, [E("f", "damaged", DAMAGED)])
    # Damage the stored bytes of one file (same size): its chunk no longer matches.
    raw = bytearray((store / top).read_bytes())
    at = raw.index(DAMAGED)
    raw[at : at + 4] = b"EVIL"
    mountpoint, process = _mount(tmp, store, [lower, upper, top])
    (store / top).write_bytes(bytes(raw))
    try:
        yield mountpoint, tmp
    finally:
        process.terminate()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
    assert not os.path.ismount(mountpoint)  # unmounted on SIGTERM


def test_files_links_and_modes_are_the_index(image: tuple[Path, Path]) -> None:
    root, _ = image
    assert sorted(os.listdir(root)) == ["damaged", "etc", "home", "lib", "srv", "usr"]
    assert (root / "usr/bin/hello").read_bytes() == b"#!/bin/sh\necho hello\n"
    hello = os.stat(root / "usr/bin/hello")
    assert stat.S_IMODE(hello.st_mode) == 0o755 and stat.S_ISREG(hello.st_mode)
    assert os.readlink(root / "lib") == "usr/lib"
    assert (
        hashlib.sha256((root / "lib/big.bin").read_bytes()).digest() == hashlib.sha256(BIG).digest()
    )
    big, again = os.stat(root / "usr/lib/big.bin"), os.stat(root / "usr/lib/big-link.bin")
    assert big.st_ino == again.st_ino and big.st_nlink == 2 and big.st_size == len(BIG)
    secret = os.stat(root / "home/user/secret")
    assert (stat.S_IMODE(secret.st_mode), secret.st_uid, secret.st_gid) == (0o600, 1000, 1000)
    assert (root / "etc/motd").read_text() == "welcome\n"
    assert not (root / "etc/gone").exists()  # whited out by the upper layer
    assert (root / "etc/resolv.conf").is_file() and (root / "srv/app").is_dir()  # mount points
    with pytest.raises(FileNotFoundError):
        os.stat(root / "usr/bin/missing")


def test_a_range_read_and_a_read_past_the_end(image: tuple[Path, Path]) -> None:
    root, _ = image
    with open(root / "usr/lib/big.bin", "rb") as handle:
        handle.seek(2 * 1024 * 1024 - 10)
        assert handle.read(20) == BIG[2 * 1024 * 1024 - 10 : 2 * 1024 * 1024 + 10]
        handle.seek(len(BIG) + 5)
        assert handle.read(10) == b""


def test_nothing_can_be_written(image: tuple[Path, Path]) -> None:
    root, _ = image
    for action in (
        lambda: os.open(root / "etc/motd", os.O_WRONLY),
        lambda: (root / "etc/new").write_text("x"),
        lambda: os.mkdir(root / "etc/folder"),
        lambda: os.unlink(root / "etc/motd"),
    ):
        with pytest.raises(OSError) as raised:
            action()
        assert raised.value.errno == errno.EROFS
    assert (root / "etc/motd").read_text() == "welcome\n"


def test_a_damaged_chunk_is_refused_not_served(image: tuple[Path, Path]) -> None:
    root, tmp = image
    with pytest.raises(OSError) as raised:
        (root / "damaged").read_bytes()
    assert raised.value.errno == errno.EIO
    with pytest.raises(OSError):  # again: refused each time, never cached as good
        (root / "damaged").read_bytes()
    assert (root / "etc/motd").read_text() == "welcome\n"  # the rest of the image serves
    deadline = time.monotonic() + 5
    while json.loads((tmp / "stats.json").read_text())["refused_chunks"] < 1:
        assert time.monotonic() < deadline, "the refusal was not counted"
        time.sleep(0.05)


def test_checked_chunks_are_kept_in_the_nodes_disk_cache(image: tuple[Path, Path]) -> None:
    """Written behind the reads (so waited for here), a marker per chunk as for weights;
    a refused chunk is not kept."""
    root, tmp = image
    (root / "usr/lib/big.bin").read_bytes()
    objects = tmp / "cache/objects"
    by_layer = {path.read_text().rsplit("/", 1)[1]: path for path in objects.glob("*.url")}
    damaged = next(
        sha for sha in by_layer if b"EVIL" + DAMAGED[4:] in (tmp / "store" / sha).read_bytes()
    )
    deadline = time.monotonic() + 10
    for sha, url_file in by_layer.items():
        markers = url_file.with_suffix(".chunks")
        if sha == damaged:
            continue
        while not (markers.is_dir() and any(markers.iterdir())):
            assert time.monotonic() < deadline, f"no chunk of {sha[:12]} kept on disk"
            time.sleep(0.05)
    assert not any(by_layer[damaged].with_suffix(".chunks").glob("*"))


def test_a_mount_ends_when_its_lifeline_closes(image: tuple[Path, Path], tmp_path: Path) -> None:
    """The agent holds the other end: however it ends, its mounts go with it."""
    store = tmp_path / "store"
    sha = layer_tar(store, [E("f", "etc/motd", b"hello\n")])
    reading, writing = os.pipe()
    mountpoint, process = _mount(tmp_path, store, [sha], lifeline=reading)
    os.close(reading)
    try:
        assert os.path.ismount(mountpoint)
        os.close(writing)  # as when the agent dies
        assert process.wait(timeout=10) == 0
        assert not os.path.ismount(mountpoint)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
