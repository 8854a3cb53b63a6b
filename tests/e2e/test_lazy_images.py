"""Lazy image roots against a real `ember server`'s store (issue 38, item 3): a small
image's layer tars stored as a build stores them (tests/small_images.py: this node's
Debian python3.11 and the libraries it loads, then a layer with a file), then a replica
of an app on that image starts on its lazy root (`ember ls` says so) and a restored one
serves on it; a node's `LazyImageRoots` makes the file index once (stored, named in the
image's record), mounts it (FUSE), and serves its files by byte ranges of the stored
tars; a second agent on the node finds the same mount (one per image per node); a node
told not to use FUSE extracts the image instead and says why; `ember image rm` drops
the index too."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, replicas_ready, wait_for
from machine_needs import need
from small_images import E, host_python_layer, layer_tar

import ember
from ember_worker.images.layer_store import LayerStore
from ember_worker.images.lazy.image_indexes import RECORD_FIELD, ensure_index
from ember_worker.images.lazy.lazy_roots import MODE_ENV, LazyImageRoots, mounted

IMAGE = ember.Image.debian_slim(python="3.11").run_commands("echo lazy > /srv/greeting")
BIG = os.urandom(5 * 1024 * 1024)
APP = """
import os
import sys
import time

import ember

image = ember.Image.debian_slim(python="3.11").run_commands("echo lazy > /srv/greeting")


@ember.endpoint(image=image, max_replicas=2, concurrency=1, scaledown_window=60)
class Lazy:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.loaded_pid = int(os.environ.get("EMBER_REPLICA_PID") or 0)

    @ember.method
    def where(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {
            "greeting": open("/srv/greeting").read(),
            "big": os.path.getsize("/usr/lib/big.bin"),
            "executable": sys.executable,
            "pid": int(os.environ.get("EMBER_REPLICA_PID") or 0),
            "loaded_pid": self.loaded_pid,
        }
"""


@pytest.fixture(scope="module")
def store(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayerStore]:
    """The image stored: its layers under the digests of IMAGE's steps, then its record."""
    if os.geteuid() != 0:
        need("root", "mounting a FUSE file system for every user (allow_other)")
    if importlib.util.find_spec("pyfuse3") is None or not os.path.exists("/dev/fuse"):
        need("packages", "pyfuse3 and /dev/fuse (bash infra/install.sh)")
    token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
    layer_store = LayerStore(platform.url, token, platform.ca)
    tars = tmp_path_factory.mktemp("tars")
    shas = [
        host_python_layer(tars),
        layer_tar(
            tars,
            [
                E("f", "srv/greeting", b"lazy\n"),
                E("f", "usr/lib/big.bin", BIG),
                E("f", "etc/os-release", b"NAME=tiny\n"),
            ],
        ),
    ]
    entries = []
    for layer, sha in zip(IMAGE.layers, shas, strict=True):
        entry = layer_store.put_layer(layer.digest, layer.step["kind"], tars / sha)
        entries.append({"digest": layer.digest, **entry})
    record = {"digest": IMAGE.digest, "layers": entries, "env": {}, "workdir": "/srv/app"}
    layer_store.put_record(IMAGE.digest, record)
    yield layer_store
    layer_store.close()


def test_a_replica_runs_on_the_lazy_root_and_a_restored_one_too(
    store: LayerStore, platform: Platform, tmp_path: Path
) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    deployed = platform.ember("deploy", str(app), "--name", "lazy", "--wait", timeout=300)
    assert "built already, nothing to build" in deployed.stderr
    lazy = ember.Endpoint.lookup("lazy", "lazy", config=platform.config())
    first = lazy.where.call()
    assert first["greeting"] == "lazy\n" and first["big"] == len(BIG)
    assert first["executable"] == "/usr/bin/python3.11"  # the image's, not the worker's
    start = platform.endpoint_status("lazy--lazy")["last_start"]
    assert start["kind"] == "cold" and start["image_root"] == "lazy"
    assert "image root: lazy" in platform.ember("ls").stdout
    problem = platform.status()["workers"][0]["snapshots"].get("problem")
    if problem:
        need("criu", f"snapshots are off on this machine: {problem}")
    # A restore on the node: the dump recorded the FUSE root's bind mounts as external.
    wait_for(lambda: platform.endpoint_status("lazy--lazy")["snapshots"], 60)
    with replicas_ready(platform, lazy, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: lazy.where.call(seconds=1.0), range(2)))
    restored = [r for r in results if r["pid"] != r["loaded_pid"]]
    assert restored and restored[0]["greeting"] == "lazy\n", results
    start = platform.endpoint_status("lazy--lazy")["last_start"]
    assert start["kind"] == "restore" and start["image_root"] == "lazy"


def test_a_replica_without_snapshots_imports_from_its_first_instruction_as_its_user(
    store: LayerStore, platform: Platform, tmp_path: Path
) -> None:
    """Without a snapshot phase the replica is its workspace's uid from the start, so
    the folders on its Python path that hold only mount points must still be listable
    (Python's importer finds nothing in one it may not read)."""
    app = tmp_path / "app.py"
    app.write_text(
        APP.replace("class Lazy:", "class Plain:")
        .replace("@ember.endpoint(image=image,", "@ember.endpoint(image=image, snapshot=False,")
        .replace("@ember.enter(snap=True)", "@ember.enter()")
    )
    platform.ember("deploy", str(app), "--name", "plain", "--wait", timeout=300)
    plain = ember.Endpoint.lookup("plain", "plain", config=platform.config())
    assert plain.where.call()["greeting"] == "lazy\n"
    platform.ember("stop", "plain")


def test_a_lazy_root_serves_the_image_from_the_store(
    store: LayerStore, platform: Platform, tmp_path: Path
) -> None:
    roots = LazyImageRoots(store, tmp_path / "node", platform.ca)
    twin = LazyImageRoots(store, tmp_path / "node", platform.ca)  # an agent after a restart
    try:
        root = asyncio.run(roots.root_for(IMAGE))
        assert roots.how(IMAGE) == {"root": "lazy", "why": ""}
        assert mounted(root)
        assert (root / "srv/greeting").read_text() == "lazy\n"
        assert (root / "usr/lib/big.bin").read_bytes() == BIG
        assert os.readlink(root / "lib64") == "usr/lib64"
        assert os.access(root / "usr/bin/python3.11", os.X_OK)
        assert (root / "etc/resolv.conf").is_file() and (root / "srv/app").is_dir()
        stats = roots.stats(IMAGE)
        assert stats == {} or stats["refused_chunks"] == 0
        # The index is stored and named in the record: made once per cluster.
        named = store.record(IMAGE.digest)
        assert named is not None and len(named[RECORD_FIELD]["sha256"]) == 64

        assert asyncio.run(twin.root_for(IMAGE)) == root  # the same mount, not a second
        mounts = Path("/proc/self/mountinfo").read_text().count(f" {root} ")
        assert mounts == 1
    finally:
        roots.close()
        twin.close()
    assert not mounted(root)


def test_without_fuse_the_image_is_extracted_saying_why(
    store: LayerStore, platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODE_ENV, "extracted")
    roots = LazyImageRoots(store, tmp_path / "node", platform.ca)
    root = asyncio.run(roots.root_for(IMAGE))
    assert roots.how(IMAGE) == {"root": "extracted", "why": f"{MODE_ENV}=extracted"}
    assert not mounted(root) and (root / "srv/greeting").read_text() == "lazy\n"


def test_a_mount_reads_on_from_the_next_server_when_its_own_is_gone(
    store: LayerStore, platform: Platform, tmp_path: Path
) -> None:
    """A platform of several control-plane processes shares one store: a read whose
    server does not answer goes to the next of the mount's list."""
    _, index = ensure_index(store, IMAGE.digest, tmp_path / "indexes")
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        gone = f"https://127.0.0.1:{probe.getsockname()[1]}"
    token = tmp_path / "token"
    token.write_text(str(store.client.headers["authorization"]).removeprefix("Bearer "))
    root = tmp_path / "root"
    root.mkdir()
    mount = [sys.executable, "-m", "ember_worker.images.lazy.mount_process"]
    options = ["--index", str(index), "--mountpoint", str(root), "--ca", platform.ca]
    options += ["--store", f"{gone},{platform.url}", "--token-file", str(token)]
    process = subprocess.Popen([*mount, *options], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        assert (root / "usr/lib/big.bin").read_bytes() == BIG
        assert (root / "srv/greeting").read_text() == "lazy\n"
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
    assert not mounted(root)


def test_dropping_the_image_drops_its_index(store: LayerStore, platform: Platform) -> None:
    record = store.record(IMAGE.digest)
    assert record is not None
    index = record[RECORD_FIELD]["sha256"]
    answer = store.client.get(f"/v1/image-blobs/sha256:{index}", headers={"Range": "bytes=0-3"})
    assert answer.status_code == 206 and answer.content == b"\x28\xb5\x2f\xfd"  # zstd
    platform.ember("image", "rm", IMAGE.digest)
    assert store.client.get(f"/v1/image-blobs/sha256:{index}").status_code == 404
