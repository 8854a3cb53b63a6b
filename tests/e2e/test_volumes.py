"""ember.Volume: files an app's replicas and clients share, kept by the control plane,
reached over HTTPS with tokens that may call the app, and from `ember volume`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
from harness import Platform, running_platform, wait_for

import ember
import ember.state.volumes
from ember.calling.tlsclient import client_context

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
        # The worker says so once the copy is gone: a moment after, in its output.
        wait_for(
            lambda: any(
                "removed this node's copy of volume shelved/shelf" in line
                for line in platform.output
            ),
            timeout=10,
        )
        # The volume itself is whole, and a new replica makes a new copy.
        platform.deploy(apps_dir / "shelved.py", APP)
        assert read.call(path="a.txt") == "kept in the volume"
        assert (copy / "big.bin").stat().st_size == 2 * 1024 * 1024


# ----- a client's local copy (under EMBER_VOLUMES_DIR), against a real platform -------
@pytest.fixture
def copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "copies"
    monkeypatch.setenv("EMBER_VOLUMES_DIR", str(root))
    return root


def _fresh(platform: Platform, name: str) -> ember.Volume:
    volume = ember.Volume(name, app=APP, config=platform.config())
    volume.clear()
    return volume


def test_a_file_written_while_it_is_committed_is_sent_again(
    platform: Platform, deployed: dict[str, str], copies: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shelf = _fresh(platform, "racing")
    (shelf.path / "a.txt").write_text("first")
    sent = ember.state.volumes._chunks_of

    def rewritten_while_sent(path: Path) -> Iterator[bytes]:
        yield from sent(path)
        path.write_text("second, written while the first was sent")

    monkeypatch.setattr(ember.state.volumes, "_chunks_of", rewritten_while_sent)
    assert shelf.commit() == ["a.txt"]
    monkeypatch.setattr(ember.state.volumes, "_chunks_of", sent)
    assert shelf.commit() == ["a.txt"]  # the next commit sends what the file holds now
    assert shelf.read_file("a.txt") == b"second, written while the first was sent"
    assert shelf.commit() == []


def test_a_reload_leaves_out_files_removed_meanwhile_and_keeps_what_it_fetched(
    platform: Platform, deployed: dict[str, str], copies: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shelf = _fresh(platform, "vanishing")
    other = ember.Volume("vanishing", app=APP, config=platform.config())
    for name in ("a.txt", "b.txt", "c.txt"):
        other.write_file(name, name)
    listed = shelf.listdir

    def listed_then_removed(prefix: str = "") -> list[ember.state.volumes.VolumeFile]:
        files = listed(prefix)
        other.remove("b.txt")  # another client, between the listing and the fetch
        return files

    monkeypatch.setattr(shelf, "listdir", listed_then_removed)
    assert shelf.reload() == ["a.txt", "c.txt"]
    monkeypatch.undo()
    (shelf.path / "a.txt").write_text("edited here")
    assert shelf.reload() == []  # what it fetched is known: nothing again
    assert (shelf.path / "a.txt").read_text() == "edited here"
    assert sorted(p.name for p in shelf.path.iterdir()) == ["a.txt", "c.txt"]


def test_listings_and_reloads_page_through_a_large_volume(
    platform: Platform, deployed: dict[str, str], copies: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ember.state.volumes, "LIST_PAGE_FILES", 2)  # pages of 2: 3 for 5 files
    shelf = _fresh(platform, "paged")
    paths = ["a/1", "a/2", "a/3", "b", "c"]
    for path in paths:
        shelf.write_file(path, path)
    assert [f.path for f in shelf.listdir()] == paths
    assert [f.path for f in shelf.listdir("a")] == ["a/1", "a/2", "a/3"]
    assert shelf.reload() == paths
    assert shelf.reload() == []  # nothing past a page's end is taken for removed
    assert (shelf.path / "c").read_text() == "c"
    assert shelf.download("a", copies / "down") == [copies / "down" / n for n in "123"]


def test_a_reload_keeps_what_changed_here_in_the_way_of_the_volumes_files(
    platform: Platform,
    deployed: dict[str, str],
    copies: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shelf = _fresh(platform, "clashing")
    other = ember.Volume("clashing", app=APP, config=platform.config())
    for path, text in (("doc.txt", "v1"), ("swap", "a file"), ("flip/x", "in a folder")):
        other.write_file(path, text)
    copy = shelf.path
    # Made or changed here, not committed:
    (copy / "res").mkdir()
    (copy / "res" / "mine.txt").write_text("mine")
    (copy / "doc.txt").write_text("local edit")
    (copy / "new.txt").write_text("made here")
    (copy / "tree").write_text("a file here")
    (copy / "same.txt").write_text("same")
    # Meanwhile in the volume:
    other.remove("swap")
    other.remove("flip/x")
    for path, text in (
        ("res", "a file there"),
        ("doc.txt", "v2"),
        ("new.txt", "made there"),
        ("tree/leaf", "leaf"),
        ("same.txt", "same"),
        ("plain.txt", "plain"),
        ("swap/in", "now a folder"),
        ("flip", "now a file"),
    ):
        other.write_file(path, text)
    with caplog.at_level(logging.WARNING, logger="ember.state.volumes"):
        assert sorted(shelf.reload()) == ["flip", "flip/x", "plain.txt", "swap", "swap/in"]
    kept = {"res/mine.txt": "mine", "doc.txt": "local edit", "new.txt": "made here"}
    for path, text in {**kept, "tree": "a file here", "same.txt": "same"}.items():
        assert (copy / path).read_text() == text
    assert (copy / "swap" / "in").read_text() == "now a folder"
    assert (copy / "flip").read_text() == "now a file"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4, warned
    for name in ("folder res,", "doc.txt,", "new.txt,", "file tree,"):
        assert sum(name in line for line in warned) == 1, (name, warned)
    assert all("commit()" in line for line in warned)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ember.state.volumes"):
        assert shelf.reload() == []  # the same again, no error
    assert len(caplog.records) == 4
    # A commit sends this copy's versions, and names what the volume cannot take.
    with pytest.raises(ember.state.volumes.VolumeConflictError) as refused:
        shelf.commit()
    assert [c.split(" ")[0] for c in refused.value.conflicts] == ["res/mine.txt", "tree"]
    assert shelf.read_file("doc.txt") == b"local edit"
    assert shelf.read_file("new.txt") == b"made here"
    assert shelf.read_file("res") == b"a file there"


def test_downloads_and_copies_get_the_mode_the_umask_allows(
    platform: Platform, deployed: dict[str, str], copies: Path, tmp_path: Path
) -> None:
    shelf = _fresh(platform, "modes")
    shelf.write_file("a.txt", "a")
    previous = os.umask(0o027)
    try:
        (downloaded,) = shelf.download("a.txt", tmp_path / "a.txt")
        assert stat.S_IMODE(downloaded.stat().st_mode) == 0o640
        assert stat.S_IMODE((shelf.path / "a.txt").stat().st_mode) == 0o640
    finally:
        os.umask(previous)


def test_a_commit_sends_files_named_like_temporaries_and_stale_temporaries_go(
    platform: Platform, deployed: dict[str, str], copies: Path
) -> None:
    shelf = _fresh(platform, "dotfiles")
    copy = shelf.path
    (copy / ".ember-notes.txt").write_text("a user's file")
    (copy / ".ember-settings").write_text("a user's file named as mkstemp names")
    (copy / ".ember-k2j4h5g1").write_bytes(b"an older SDK's fetch, cut short")
    (copy / ".ember-k2j4h5g1").chmod(0o600)  # as mkstemp made it
    incoming = copy.parent / ".dotfiles.incoming"  # a reload's fetch, cut short
    incoming.mkdir()
    (incoming / "x.partial").write_bytes(b"partial")
    assert shelf.commit() == [".ember-notes.txt", ".ember-settings"]
    assert not (copy / ".ember-k2j4h5g1").exists()
    assert shelf.reload() == [] and not incoming.exists()
    assert [f.path for f in shelf.listdir()] == [".ember-notes.txt", ".ember-settings"]


def test_volume_paths_may_be_path_objects_and_contents_bytes_or_text(
    platform: Platform, deployed: dict[str, str]
) -> None:
    shelf = _fresh(platform, "typed")
    shelf.write_file(PurePosixPath("ab/c.txt"), b"x")
    shelf.write_file("ab/d.txt", bytearray(b"y"))
    assert [f.path for f in shelf.listdir(Path("ab"))] == ["ab/c.txt", "ab/d.txt"]
    assert shelf.read_file(Path("ab/c.txt")) == b"x"
    assert asyncio.run(shelf.aread_file(Path("ab/d.txt"))) == b"y"
    with pytest.raises(ember.InvalidError, match="bytes or str, not int"):
        shelf.write_file("n.txt", 5)  # type: ignore[arg-type]
    assert shelf.remove(Path("ab"), recursive=True) == 2


def test_the_cli_puts_into_and_gets_into_folders_and_says_what_is_in_the_way(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    shelf = _fresh(platform, "cli-targets")
    shelf.write_file("data/a.txt", "A")
    shelf.write_file("data/b/c.txt", "C")
    target = f"{APP}/cli-targets"
    (tmp_path / "dl3").write_text("in the way")
    refused = platform.ember("volume", "get", target, "data", str(tmp_path / "dl3"), check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"ember: cannot write {tmp_path / 'dl3' / 'a.txt'}: {tmp_path / 'dl3'} is a file, "
        "not a folder"
    ]
    assert (tmp_path / "dl3").read_text() == "in the way"
    platform.ember("volume", "get", target, "data/a.txt", f"{tmp_path / 'dl2'}/")
    assert (tmp_path / "dl2" / "a.txt").read_text() == "A"
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "a.txt").write_text("up")
    platform.ember("volume", "put", target, str(tmp_path / "up" / "a.txt"), "dest/")
    assert shelf.read_file("dest/a.txt") == b"up"
    assert "dest" not in [f.path for f in shelf.listdir()]
