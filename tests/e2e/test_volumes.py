"""ember.Volume: files an app's replicas and clients share, kept by the control plane,
reached over HTTPS with tokens that may call the app, and from `ember volume`."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from pathlib import Path

import pytest
from harness import Platform, running_platform, wait_for

import ember
from ember.tlsclient import client_context

APP = "shelved"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "shelved.py", APP)


def _volume_blobs(platform: Platform) -> list[str]:
    folder = platform.state_dir / "blobs" / "volumes"
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def test_replicas_and_clients_share_a_volume(platform: Platform, deployed: dict[str, str]) -> None:
    config = platform.config()
    shelf = ember.Volume("shelf", app=APP, config=config)
    shelf.clear()
    save, read, discard = (
        ember.Endpoint.lookup(APP, name, config=config) for name in ("save", "read", "discard")
    )
    # A client's file reaches a replica's copy; a replica's commit reaches the client.
    shelf.write_file("in/a.txt", "hello")
    assert read.call(path="in/a.txt") == "hello"
    assert save.call(path="out/b.txt", text="world") == ["out/b.txt"]
    assert shelf.read_file("out/b.txt") == b"world"
    assert [f.path for f in shelf.listdir()] == ["in/a.txt", "out/b.txt"]
    assert [f.path for f in shelf.listdir("out")] == ["out/b.txt"]
    # A newer version replaces the copy's on reload; a file removed in a copy goes.
    shelf.write_file("in/a.txt", "bye")
    assert read.call(path="in/a.txt") == "bye"
    assert discard.call(path="out/b.txt") == ["out/b.txt"]
    assert [f.path for f in shelf.listdir()] == ["in/a.txt"]
    assert read.call(path="out/b.txt") is None
    # Committing with nothing changed sends nothing.
    assert save.call(path="in/a.txt", text="bye") == []
    # A reload keeps what the copy changed and has not committed yet.
    local = ember.Endpoint.lookup(APP, "edit-uncommitted", config=config)
    assert local.call(path="in/a.txt", text="draft") == "draft"
    assert shelf.read_file("in/a.txt") == b"bye"


def test_files_round_trip_whole_and_contents_are_stored_once(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    shelf = ember.Volume("blobs", app=APP, config=platform.config())
    shelf.clear()
    data = os.urandom(5 * 1024 * 1024 + 17)  # several chunks each way
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    first = shelf.write_file("big.bin", data)
    assert (first.size, first.digest) == (len(data), digest)
    shelf.write_file("copy/big.bin", data)
    assert shelf.read_file("copy/big.bin") == data
    assert asyncio.run(shelf.aread_file("copy/big.bin")) == data  # the asyncio twin
    assert _volume_blobs(platform).count(digest.replace(":", "-")) == 1
    downloaded = shelf.download("copy", tmp_path / "copy")
    assert downloaded == [tmp_path / "copy" / "big.bin"]
    assert (tmp_path / "copy" / "big.bin").read_bytes() == data
    # A file into a folder that exists goes inside it, and the folder keeps its files.
    (tmp_path / "keep.txt").write_text("mine")
    assert shelf.download("big.bin", tmp_path) == [tmp_path / "big.bin"]
    assert (tmp_path / "keep.txt").read_text() == "mine"
    # The last file with that content gone, its blob goes too.
    assert shelf.remove("big.bin") == 1 and shelf.remove("copy", recursive=True) == 1
    assert digest.replace(":", "-") not in _volume_blobs(platform)
    assert shelf.listdir() == []


def test_bad_paths_conflicts_and_other_apps_tokens_are_refused(
    platform: Platform, deployed: dict[str, str]
) -> None:
    config = platform.config()
    shelf = ember.Volume("rules", app=APP, config=config)
    shelf.clear()
    shelf.write_file("a/b.txt", "x")
    with pytest.raises(ember.InvalidError, match="not allowed"):
        shelf.write_file("../escape", "x")  # refused before it is sent
    with platform.client() as client:
        base = f"/v1/apps/{APP}/volumes/rules/files"
        assert client.put(f"{base}/a/%2E%2E/x", content=b"x").status_code == 400
        # A file cannot also be a folder, nor a folder a file.
        conflict = client.put(f"{base}/a/b.txt/c", content=b"x")
        assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "path_conflict"
        assert client.put(f"{base}/a", content=b"x").status_code == 409
        assert client.get(f"{base}/a/b.txt", headers={"Authorization": ""}).status_code == 401
    with pytest.raises(ember.RemoteError, match="is_a_folder"):
        shelf.remove("a")
    with pytest.raises(ember.NotFoundError):
        shelf.read_file("missing.txt")
    other = platform.ember("token", "create", "--app", "someone-else").stdout.strip()
    foreign = config.__class__(config.server_url, other, config.ca_cert, config.domain)
    with pytest.raises(ember.NotFoundError, match="no app named"):
        ember.Volume("rules", app=APP, config=foreign).listdir()
    assert [f.path for f in shelf.listdir()] == ["a/b.txt"]  # nothing was lost


def test_an_upload_cut_short_keeps_nothing(platform: Platform, deployed: dict[str, str]) -> None:
    shelf = ember.Volume("cut", app=APP, config=platform.config())
    shelf.write_file("kept.txt", "old")
    host, port = platform.url.removeprefix("https://").rstrip("/").split(":")
    request = (
        f"PUT /v1/apps/{APP}/volumes/cut/files/kept.txt HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {platform.token}\r\nContent-Length: 1000000\r\n\r\n"
    ).encode()
    with (
        socket.create_connection((host, int(port))) as raw,
        client_context(platform.ca).wrap_socket(raw, server_hostname=host) as tls,
    ):
        tls.sendall(request + b"x" * 1000)  # then the client goes away
    uploads = platform.state_dir / "blobs" / "volumes" / "uploads"
    wait_for(lambda: not uploads.is_dir() or not any(uploads.iterdir()), 10)
    assert shelf.read_file("kept.txt") == b"old"


def test_the_cli_puts_lists_gets_and_removes(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    ember.Volume("cli", app=APP, config=platform.config()).clear()
    source = tmp_path / "data"
    (source / "nested").mkdir(parents=True)
    (source / "one.txt").write_text("1")
    (source / "nested" / "two.txt").write_text("22")
    put = platform.ember("volume", "put", f"{APP}/cli", str(source))
    assert "uploaded 2 files" in put.stderr
    listing = platform.ember("volume", "ls", f"{APP}/cli").stdout
    assert "data/nested/two.txt" in listing and "data/one.txt" in listing
    assert "cli" in platform.ember("volume", "ls", APP).stdout
    assert platform.ember("volume", "get", f"{APP}/cli", "data/one.txt", "-").stdout == "1"
    platform.ember("volume", "get", f"{APP}/cli", "data", str(tmp_path / "back"))
    assert (tmp_path / "back" / "nested" / "two.txt").read_text() == "22"
    refused = platform.ember("volume", "rm", f"{APP}/cli", "data", check=False)
    assert refused.returncode != 0 and "recursive" in refused.stderr
    platform.ember("volume", "rm", f"{APP}/cli", "data", "-r")
    assert platform.ember("volume", "ls", f"{APP}/cli").stdout.strip() == "no files"


def test_a_nodes_copies_over_budget_go_once_their_app_has_no_replica_there(
    apps_dir: Path, tmp_path: Path
) -> None:
    extra = ("--volume-cache-gb", "0.001")  # 1 MB: one copy of the volume below is over
    with running_platform(tmp_path / "budgeted", extra=extra) as platform:
        platform.deploy(apps_dir / "shelved.py", APP)
        config = platform.config()
        shelf = ember.Volume("shelf", app=APP, config=config)
        shelf.write_file("big.bin", os.urandom(2 * 1024 * 1024))
        shelf.write_file("a.txt", "kept in the volume")
        read = ember.Endpoint.lookup(APP, "read", config=config)
        assert read.call(path="a.txt") == "kept in the volume"
        copy = platform.state_dir / "worker" / "volumes" / APP / "shelf"
        assert (copy / "big.bin").stat().st_size == 2 * 1024 * 1024
        assert copy.is_dir()  # over budget, but its app's replica may still use it
        platform.ember("stop", APP)
        wait_for(lambda: not copy.exists(), timeout=30)
        assert any(
            "removed this node's copy of volume shelved/shelf" in line for line in platform.output
        )
        # The volume itself is whole, and a new replica makes a new copy.
        platform.deploy(apps_dir / "shelved.py", APP)
        assert read.call(path="a.txt") == "kept in the volume"
        assert (copy / "big.bin").stat().st_size == 2 * 1024 * 1024
