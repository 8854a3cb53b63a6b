"""A worker's layer store moves with its session: once the agent's session is on another
control-plane process (the next of `--server a,b`), image layers and records come from
that one, as bundles and snapshot images do. Two real HTTP servers on loopback stand for
two processes of one platform."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ember_worker.images.layer_store import LayerStore


def _server(name: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"served_by": name, "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def two_servers() -> Iterator[list[str]]:
    servers = [_server("first"), _server("second")]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_records_come_from_the_server_the_session_moved_to(two_servers: list[str]) -> None:
    store = LayerStore(two_servers[0] + "/", "token", None)
    try:
        assert store.server_url == two_servers[0]
        assert store.record("sha256:aa") == {"served_by": "first", "path": "/v1/images/sha256:aa"}
        store.server_url = two_servers[1] + "/"
        assert store.server_url == two_servers[1]
        assert store.layer("sha256:bb") == {
            "served_by": "second",
            "path": "/v1/image-layers/sha256:bb",
        }
    finally:
        store.close()
