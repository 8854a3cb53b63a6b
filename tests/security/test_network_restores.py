"""Snapshots of replicas that have networks of their own (issue 48): a replica holding a
TCP listener on its own loopback (an engine's sidecar) and an open connection to it at
its quiet point is dumped with both, and each restore, in a fresh namespace of its own,
listens again, carries on over the held connection, serves, and reaches out (a server
in a network namespace of the test's own stands in for the internet). And an endpoint
that starts a server process on its own loopback and proxies to it serves, cold and
restored."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, replicas_ready, running_platform, wait_for
from machine_needs import need
from test_network import internet_stand_in

import ember

APP = "sockets"
LABEL = f"{APP}--sidecar"

SIDECAR_APP = """\
import os
import socket
import threading
import time

import ember


def host_pid():
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


def _echo(conn):
    with conn:
        while data := conn.recv(100):
            conn.sendall(b"echo:" + data)


def _serve(listener):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def _ask(sock, word):
    sock.settimeout(10)
    sock.sendall(word.encode())
    return sock.recv(100).decode()


@ember.endpoint(name="sidecar", max_replicas=2, concurrency=1, scaledown_window=120)
class Sidecar:
    @ember.enter(snap=True)
    def load(self):
        self.loaded_pid = host_pid()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=_serve, args=(self.listener,), daemon=True).start()
        self.held = socket.create_connection(("127.0.0.1", self.port))
        assert _ask(self.held, "before") == "echo:before"

    @ember.method
    def check(self, host: str, port: int, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as fresh:
            new = _ask(fresh, "new")
        try:
            with socket.create_connection((host, port), timeout=10) as out:
                outside = out.recv(100).decode().strip()
        except OSError as exc:
            outside = type(exc).__name__
        return {
            "pid": host_pid(),
            "loaded_pid": self.loaded_pid,
            "new": new,
            "held": _ask(self.held, "held"),
            "outside": outside,
        }
"""


PROXY_APP = """\
import os
import socket
import subprocess
import sys
import time
import urllib.request

import ember

SERVER = (
    "import http.server, sys\\n"
    "class Page(http.server.BaseHTTPRequestHandler):\\n"
    "    def do_GET(self):\\n"
    "        self.send_response(200)\\n"
    "        self.end_headers()\\n"
    "        self.wfile.write(b'served-by-the-child')\\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), Page).serve_forever()\\n"
)


def host_pid():
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


@ember.endpoint(name="proxy", max_replicas=2, concurrency=1, scaledown_window=120)
class Proxy:
    @ember.enter(snap=True)
    def start(self):
        self.loaded_pid = host_pid()
        with socket.socket() as probe:  # a free port of its own loopback
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = subprocess.Popen([sys.executable, "-c", SERVER, str(self.port)])
        for _ in range(200):
            try:
                self.get()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the server process did not answer")

    def get(self):
        url = f"http://127.0.0.1:{self.port}/page"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.read().decode()

    @ember.method
    def fetch(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {"pid": host_pid(), "loaded_pid": self.loaded_pid, "page": self.get()}
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "replicas get networks of their own from a root worker")
    with running_platform(tmp_path_factory.mktemp("network-restores")) as running:
        problem = running.status()["workers"][0]["snapshots"].get("problem")
        if problem:
            need("criu", f"snapshots are off on this machine: {problem}")
        yield running


def test_a_replica_holding_a_listener_and_a_connection_is_restored_listening(
    platform: Platform, tmp_path: Path
) -> None:
    app = tmp_path / "app.py"
    app.write_text(SIDECAR_APP)
    platform.deploy(app, APP)
    sidecar = ember.Endpoint.lookup(APP, "sidecar", config=platform.config())
    with internet_stand_in() as (address, port):
        first = sidecar.check.call(host=address, port=port)
        assert first["pid"] == first["loaded_pid"]  # booted cold
        assert (first["new"], first["held"]) == ("echo:new", "echo:held"), first
        assert first["outside"] == "from-the-internet", first
        try:
            wait_for(lambda: platform.endpoint_status(LABEL)["snapshots"], 90)
        except AssertionError:
            logs = platform.ember("logs", f"{APP}/sidecar", "-n", "300").stdout
            raise AssertionError(f"no snapshot was taken: {logs[-1500:]}") from None
        # A second replica, restored from the image, beside the first: one slow call each.
        with replicas_ready(platform, sidecar, 2), ThreadPoolExecutor(max_workers=2) as pool:
            results = list(
                pool.map(
                    lambda _: sidecar.check.call(host=address, port=port, seconds=2.0), range(2)
                )
            )
    restored = [r for r in results if r["pid"] != first["pid"]]
    assert len(restored) == 1, results
    again = restored[0]
    assert again["loaded_pid"] == first["pid"], "not restored from the first replica's image"
    assert again["new"] == "echo:new", f"the restore does not listen again: {again}"
    assert again["held"] == "echo:held", f"the held connection did not carry on: {again}"
    assert again["outside"] == "from-the-internet", f"the restore cannot reach out: {again}"
    logs = platform.ember("logs", f"{APP}/sidecar", "-n", "300").stdout
    assert "restored from a snapshot" in logs, logs[-2000:]


def test_an_endpoint_proxying_to_its_own_server_process_serves_cold_and_restored(
    platform: Platform, tmp_path: Path
) -> None:
    app = tmp_path / "app.py"
    app.write_text(PROXY_APP)
    platform.deploy(app, "proxying")
    proxy = ember.Endpoint.lookup("proxying", "proxy", config=platform.config())
    first = proxy.fetch.call()
    assert first["page"] == "served-by-the-child" and first["pid"] == first["loaded_pid"]
    try:
        wait_for(lambda: platform.endpoint_status("proxying--proxy")["snapshots"], 90)
    except AssertionError:
        logs = platform.ember("logs", "proxying/proxy", "-n", "300").stdout
        raise AssertionError(f"no snapshot was taken: {logs[-1500:]}") from None
    with replicas_ready(platform, proxy, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: proxy.fetch.call(seconds=2.0), range(2)))
    restored = [r for r in results if r["pid"] != first["pid"]]
    assert len(restored) == 1 and restored[0]["loaded_pid"] == first["pid"], results
    assert restored[0]["page"] == "served-by-the-child", restored
