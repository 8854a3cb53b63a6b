"""The worker's bundle cache: an extracted folder is checked against what was extracted
before each start (and extracted again if it changed), and folders no replica uses go
once the extracted total passes the budget. Bundles come from a real HTTP server."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.bundle import build_bundle
from ember_worker.agent.bundles import BundleCache


class BundleServer:
    """Serves GET /v1/bundles/{digest} from memory, counting the downloads."""

    def __init__(self) -> None:
        self.bundles: dict[str, bytes] = {}
        self.downloads: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                digest = self.path.rsplit("/", 1)[-1]
                server.downloads.append(digest)
                data = server.bundles[digest]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def add(self, folder: Path, files: dict[str, bytes]) -> str:
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
        bundle = build_bundle(folder)
        self.bundles[bundle.digest] = bundle.data
        return bundle.digest


@pytest.fixture
def server() -> Iterator[BundleServer]:
    served = BundleServer()
    thread = threading.Thread(target=served.http.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.http.shutdown()
        served.http.server_close()
        thread.join()


def _cache(tmp_path: Path, server: BundleServer, **kwargs: object) -> BundleCache:
    return BundleCache(tmp_path / "bundles", server.url, "token", None, **kwargs)  # type: ignore[arg-type]


APP = {"app.py": b"print('original')\n", "pkg/mod.py": b"X = 1\n", "data.bin": bytes(1000)}


def test_a_changed_folder_is_extracted_again_from_a_fresh_download(
    tmp_path: Path, server: BundleServer, caplog: pytest.LogCaptureFixture
) -> None:
    digest = server.add(tmp_path / "app", APP)
    cache = _cache(tmp_path, server)
    folder = asyncio.run(cache.ensure(digest))
    listing = cache.listing_path(digest)
    assert listing.parent == folder.parent and listing.exists()  # beside, not inside
    assert asyncio.run(cache.ensure(digest)) == folder
    assert server.downloads == [digest]  # intact: not fetched again
    assert cache.cached() == [digest]

    def tamper_modify() -> None:
        (folder / "app.py").write_bytes(b"print('evil')\n")

    def tamper_same_size() -> None:
        same_size = b"print('evil!!!!')\n"
        assert len(same_size) == len(APP["app.py"])
        (folder / "app.py").write_bytes(same_size)

    def tamper_add() -> None:
        (folder / "pkg" / "extra.py").write_text("import os\n")

    def tamper_remove() -> None:
        (folder / "data.bin").unlink()

    def tamper_link() -> None:
        (folder / "pkg" / "mod.py").unlink()
        (folder / "pkg" / "mod.py").symlink_to(tmp_path / "app" / "pkg" / "mod.py")

    def tamper_folder() -> None:
        os.rename(folder / "pkg", tmp_path / "moved")

    def tamper_replace() -> None:  # the whole folder, by a link to another
        os.rename(folder, tmp_path / "replaced")
        folder.symlink_to(tmp_path / "replaced")

    tampers = [tamper_modify, tamper_same_size, tamper_add, tamper_remove, tamper_link]
    for count, tamper in enumerate([*tampers, tamper_folder, tamper_replace], start=2):
        tamper()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ember.worker"):
            assert asyncio.run(cache.ensure(digest)) == folder
        assert len(server.downloads) == count, tamper.__name__
        assert "extracting it again from a fresh download" in caplog.text, tamper.__name__
        for name, data in APP.items():
            assert (folder / name).read_bytes() == data
        assert sorted(p.name for p in folder.rglob("*")) == ["app.py", "data.bin", "mod.py", "pkg"]
        assert not folder.is_symlink()
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".")] == []


def test_unused_folders_go_least_recently_used_first_past_the_budget(
    tmp_path: Path, server: BundleServer
) -> None:
    digests = [
        server.add(tmp_path / f"app{i}", {"app.py": f"X = {i}\n".encode(), "w.bin": bytes(4000)})
        for i in range(4)
    ]
    used: set[str] = set()
    cache = _cache(tmp_path, server, budget_bytes=10_000, in_use=lambda: used)
    a, b, c, d = digests

    async def scenario() -> None:
        await cache.ensure(a)
        await cache.ensure(b)
        assert set(cache.cached()) == {a, b}  # 8,012 bytes: within the budget
        used.add(a)  # a replica runs from a
        await cache.ensure(c)  # over: b is the least recently used that is unused
        assert set(cache.cached()) == {a, c}
        assert not cache.path(b).exists() and not cache.listing_path(b).exists()
        await cache.ensure(c)
        used.clear()  # a's replica ended
        assert await cache.trim() == []  # within the budget again
        await cache.ensure(d)
        assert set(cache.cached()) == {c, d}
        # A folder without a record (a crash mid-way, an older worker) cannot be checked.
        cache.listing_path(c).unlink()
        assert await cache.trim() == [c]
        folder = await cache.ensure(b)  # an evicted bundle comes back when a replica needs it
        assert (folder / "app.py").read_text() == "X = 1\n"

    asyncio.run(scenario())
    assert server.downloads.count(b) == 2
    assert hashlib.sha256(server.bundles[b]).hexdigest() == b.split(":")[1]


def test_a_download_follows_the_session_to_the_next_server(
    tmp_path: Path, server: BundleServer
) -> None:
    """The control plane it downloaded from went away; the agent's session moved on to
    the next of its --server list, and the next try goes there."""
    digest = server.add(tmp_path / "app", APP)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"  # refuses connections
    cache = BundleCache(tmp_path / "bundles", dead, "token", None)  # type: ignore[arg-type]

    async def scenario() -> Path:
        async def session_moves() -> None:
            await asyncio.sleep(0.2)
            cache.server_url = server.url

        mover = asyncio.ensure_future(session_moves())
        folder = await asyncio.wait_for(cache.ensure(digest), 20)
        await mover
        return folder

    folder = asyncio.run(scenario())
    assert (folder / "app.py").read_bytes() == APP["app.py"]
    assert server.downloads == [digest]
