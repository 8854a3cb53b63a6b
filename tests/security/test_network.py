"""Issue 48's network attacks, tried by a tenant holding a deploy token of its own
workspace against a real `ember server` whose replicas are sandboxed:

- a service on the node's loopback (an operator's database, a metrics agent) connected
  to from the tenant's replica and from its `ember replica exec` command;
- a listener another workspace's replica opened on its own loopback (an engine's metrics
  port) connected to;
- an abstract Unix socket of the node's connected to;
- the node's listening sockets read from `/proc/net/tcp` and `/proc/net/unix`.

Each must be refused at once (a refused connection, not a hang of the caller); and the
tenant's replica still reaches out: a server in a network namespace of the test's own,
routed from the node as the internet would be, answers it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, running_platform
from machine_needs import need

PROBE_APP = """\
import os
import socket
import time

import ember


def _reach(family, address):
    began = time.monotonic()
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(address)
            got = sock.recv(100).decode(errors="replace")
        outcome = "answered: " + got.strip()
    except OSError as exc:
        outcome = type(exc).__name__
    return {"outcome": outcome, "seconds": time.monotonic() - began}


@ember.endpoint(scaledown_window=300, snapshot=False)
def tcp(host: str, port: int) -> dict:
    return _reach(socket.AF_INET, (host, port))


@ember.endpoint(scaledown_window=300, snapshot=False)
def abstract(name: str) -> dict:
    return _reach(socket.AF_UNIX, "\\0" + name)


@ember.endpoint(scaledown_window=300, snapshot=False)
def proc_net() -> dict:
    return {name: open("/proc/net/" + name).read() for name in ("tcp", "unix")}
"""

VICTIM_APP = """\
import socket
import threading

import ember

PORT = {port}


def _serve(listener):
    while True:
        conn, _ = listener.accept()
        conn.sendall(b"victim-metrics\\n")
        conn.close()


@ember.endpoint(scaledown_window=300, snapshot=False)
def listen() -> str:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen()
    threading.Thread(target=_serve, args=(listener,), daemon=True).start()
    return "listening"
"""

# A connection from `ember replica exec`, with the interpreter the replica runs.
EXEC_PROBE = (
    "import socket,sys\n"
    "try:\n"
    "    s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10)\n"
    "    print('answered:', s.recv(100).decode().strip())\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__)\n"
)


class Tenant:
    def __init__(self, platform: Platform, folder: Path, workspace: str) -> None:
        self.platform = platform
        self.folder = folder
        self.workspace = workspace
        platform.ember("workspace", "create", workspace)
        made = platform.ember("token", "create", "--workspace", workspace, "--scope", "deploy")
        self.token = made.stdout.strip()

    def deploy(self, name: str, source: str) -> None:
        app = self.folder / self.workspace / name / "app.py"
        app.parent.mkdir(parents=True, exist_ok=True)
        app.write_text(source)
        done = self.platform.ember_as(self.token, "deploy", str(app), "--name", name)
        assert done.returncode == 0, done.stdout + done.stderr

    def call(self, label: str, body: dict[str, Any] | None = None) -> Any:
        with self.platform.client(self.token, timeout=240) as client:
            answer = client.post(f"/{self.workspace}--{label}/", json=body or {})
        assert answer.status_code == 200, answer.text
        return answer.json()


def _serve_lines(listener: socket.socket, line: bytes) -> None:
    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(line)

    threading.Thread(target=serve, daemon=True).start()


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "replicas are sandboxed, each in a network of its own, by a root worker")
    with running_platform(tmp_path_factory.mktemp("network")) as running:
        yield running


@pytest.fixture(scope="module")
def mallory(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    tenant = Tenant(platform, tmp_path_factory.mktemp("tenants"), "mallory")
    tenant.deploy("probe", PROBE_APP)
    return tenant


@pytest.fixture(scope="module")
def node_service() -> Iterator[int]:
    """A service on the node's loopback: its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    _serve_lines(listener, b"node-database\n")
    yield listener.getsockname()[1]
    listener.close()


def _refused_at_once(reached: dict[str, Any], what: str) -> None:
    assert not reached["outcome"].startswith("answered"), f"{what}: {reached['outcome']}"
    assert reached["seconds"] < 5, f"{what} hung the caller for {reached['seconds']:.1f} s"


def test_a_service_on_the_nodes_loopback_is_refused_to_a_replica(
    mallory: Tenant, node_service: int
) -> None:
    reached = mallory.call("probe--tcp", {"host": "127.0.0.1", "port": node_service})
    _refused_at_once(reached, "the node's loopback service")
    # Nor by the node's other address, through the replica's egress.
    node_address = _node_address()
    if node_address is not None:
        reached = mallory.call("probe--tcp", {"host": node_address, "port": node_service})
        _refused_at_once(reached, f"the node's address {node_address}")


def test_the_nodes_listeners_and_abstract_sockets_are_out_of_sight(
    mallory: Tenant, node_service: int
) -> None:
    name = f"ember-node-{secrets.token_hex(4)}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + name)
    abstract.listen()
    _serve_lines(abstract, b"node-abstract\n")
    try:
        reached = mallory.call("probe--abstract", {"name": name})
        _refused_at_once(reached, "the node's abstract socket")
        seen = mallory.call("probe--proc_net")
        assert f":{node_service:04X} " not in seen["tcp"], "the node's listener is listed"
        assert name not in seen["unix"], "the node's abstract socket is listed"
    finally:
        abstract.close()


def test_another_workspaces_loopback_listener_is_out_of_reach(
    platform: Platform, mallory: Tenant, tmp_path_factory: pytest.TempPathFactory
) -> None:
    port = 40_000 + secrets.randbelow(20_000)
    victim = Tenant(platform, tmp_path_factory.mktemp("victim"), "victim")
    victim.deploy("engine", VICTIM_APP.format(port=port))
    assert victim.call("engine--listen") == "listening"
    reached = mallory.call("probe--tcp", {"host": "127.0.0.1", "port": port})
    _refused_at_once(reached, "the other workspace's loopback listener")


def test_a_replica_exec_command_is_in_the_replicas_network(
    platform: Platform, mallory: Tenant, node_service: int
) -> None:
    mallory.call("probe--proc_net")  # a replica running
    listed = platform.ember_as(mallory.token, "replica", "ls", "probe", "--json")
    rows = json.loads(listed.stdout)
    replica = next((row["id"] for row in rows if row["label"].endswith("--proc-net")), None)
    assert replica is not None, listed.stdout + listed.stderr
    began = time.monotonic()
    ran = platform.ember_as(
        mallory.token,
        "replica",
        "exec",
        replica,
        "--",
        "python3",
        "-c",
        EXEC_PROBE,
        str(node_service),
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "answered" not in ran.stdout, f"replica exec reached the node: {ran.stdout}"
    assert "ConnectionRefusedError" in ran.stdout, ran.stdout
    assert time.monotonic() - began < 60


def test_a_replica_still_reaches_the_internet(mallory: Tenant) -> None:
    """A server in a network namespace of the test's own, routed from the node over a
    veth pair: what the internet is to the node."""
    with internet_stand_in() as (address, port):
        reached = mallory.call("probe--tcp", {"host": address, "port": port})
    assert reached["outcome"] == "answered: from-the-internet", reached


def _node_address() -> str | None:
    """One of the node's own non-loopback IPv4 addresses."""
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True
    )
    for line in shown.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            return words[words.index("inet") + 1].split("/")[0]
    return None


# What a stand-in's server does with each connection `c` it accepts (Python, indented
# by the loop that runs it): one line, then closed.
ONE_LINE = "c.sendall(b'from-the-internet\\n'); c.close()"


class internet_stand_in:
    """A namespace `inet-XXXX` with 10.231.N.2 on a veth pair whose node end is
    10.231.N.1, serving on a TCP port (`answer`: what it does with each connection, in
    a thread of its own): (address, port) while entered."""

    def __init__(self, answer: str = ONE_LINE) -> None:
        self.answer = answer

    def __enter__(self) -> tuple[str, int]:
        tag = secrets.token_hex(3)
        self.ns, self.veth = f"inet-{tag}", f"vinet{tag}"
        net = secrets.randbelow(200) + 20
        node_end, far_end = f"10.231.{net}.1", f"10.231.{net}.2"
        for step in (
            ["ip", "netns", "add", self.ns],
            # The peer is made in the namespace: no "far" on the node beside other tests'.
            [
                "ip",
                "link",
                "add",
                self.veth,
                "type",
                "veth",
                "peer",
                "name",
                "far",
                "netns",
                self.ns,
            ],
            ["ip", "addr", "add", f"{node_end}/30", "dev", self.veth],
            ["ip", "link", "set", self.veth, "up"],
            ["ip", "-n", self.ns, "addr", "add", f"{far_end}/30", "dev", "far"],
            ["ip", "-n", self.ns, "link", "set", "far", "up"],
            ["ip", "-n", self.ns, "link", "set", "lo", "up"],
        ):
            subprocess.run(step, check=True, capture_output=True)
        port = 8000 + secrets.randbelow(1000)
        serve = (
            "import socket, threading\n"
            f"s = socket.create_server(('{far_end}', {port}), backlog=512)\n"
            "def answer(c):\n"
            f"    {self.answer}\n"
            "print('up', flush=True)\n"
            "while True:\n"
            "    c, _ = s.accept()\n"
            "    threading.Thread(target=answer, args=(c,), daemon=True).start()\n"
        )
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-c", serve],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.server.stdout is not None and self.server.stdout.readline() == "up\n"
        return far_end, port

    def __exit__(self, *exc: object) -> None:
        self.server.kill()
        self.server.wait()
        if self.server.stdout is not None:
            self.server.stdout.close()
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
