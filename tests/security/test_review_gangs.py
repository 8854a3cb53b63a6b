"""A reviewer's attacks on gangs (a replica over several nodes, `nodes=`, `gang_ports=`),
by tenants holding deploy tokens of their own workspaces, against a real `ember server
--no-worker` and three `ember worker` agents of this machine:

- `host-1` and `host-2` share this machine's network: their gang address is the default
  127.0.0.1 (nodes on one machine), where their members' pastas take the gang's ports in;
- `remote` runs in a network namespace of the test's own, routed from this machine over a
  veth pair as another machine of the nodes' private network would be (a deployment
  over separate machines). Its channel
  to the control plane goes through a relay of the test's, from its own loopback.

The victim, `alice`, runs gangs whose members listen on their gang ports (their first,
what rank 0's MASTER_PORT is, and their last) and answer with a secret; the attacker,
`mallory`, runs ordinary replicas and gangs of its own. Each test is mallory's action
and an outcome seen on the node or by alice.

What was found, each mended since (each test says what it shows):

- with `--gang-address` naming a node's address on the nodes' private network, pasta
  took the gang's ports in there from anyone, and a replica of any workspace on another
  node reached the member's listeners: the address went, a gang's members meet on the
  loopback of the machine their nodes share, and a gang is never split over nodes that
  do not share one;
- one workspace held every gang port of the platform (8000, platform-wide, first come):
  a workspace's gangs now hold at most 2048 of them;
- after the control plane restarted, its gangs' ports were free again while the old
  members still ran their exit hooks, and a new gang of another workspace got the same
  block, its pastas binding nothing of what the old ones held (saying nothing): the ports
  of a gang a worker's hello names stay taken until its members have ended, and a
  member whose pasta does not listen on all of its ports fails to start.

Held: an ordinary replica and a gang member of another workspace on the same machine
reach nothing of a gang's at the node's loopback, their own, nor the node's addresses;
the control plane checks `nodes=` and `gang_ports=` itself at deploy (a hand-made
manifest out of range is refused).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from harness import Platform, free_port, join_worker, running_platform, wait_for
from machine_needs import need
from test_network import Tenant

from ember.errors import InvalidError
from ember.wire.spec import EndpointSpec

GANG_PORTS = (24_000, 32_000)  # the platform's, [first, end)
HOST_SIDE, REMOTE = "198.18.231.1", "198.18.231.2"  # the veth pair's ends (a /30)
CLONE_NEWNET = 0x40000000

COMMON = r'''
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ember

KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EMBER_GANG_PORTS")


def _serve(sock, line):
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            try:
                conn.sendall(line)
            except OSError:
                pass


def listen(word, last_too=True):
    """Listeners on the first and last of this member's gang ports (the first is what
    rank 0's MASTER_PORT is), each answering `word`; the rest stay its ephemeral ones."""
    first, last = (int(p) for p in os.environ["EMBER_GANG_PORTS"].split("-"))
    bound = []
    for port in (first, last) if last_too else (first,):
        sock = socket.create_server(("0.0.0.0", port))
        line = f"{word} rank {os.environ['RANK']} port {port}\n".encode()
        threading.Thread(target=_serve, args=(sock, line), daemon=True).start()
        bound.append(sock)
    return bound


def place():
    return {key: os.environ.get(key) for key in KEYS}


def _grab(target):
    """What answers at `target` once connected; None: no connection."""
    host, port = target
    try:
        sock = socket.create_connection((host, port), timeout=3)
    except OSError:
        return None
    with sock:
        sock.settimeout(3)
        try:
            return sock.recv(300).decode(errors="replace").strip() or "(connected, no word)"
        except OSError as exc:
            return f"(connected, then {type(exc).__name__})"


def scan(hosts, first, last):
    """What answers at each of `hosts`' ports `first`..`last` (those that connect)."""
    targets = [(host, port) for host in hosts for port in range(first, last + 1)]
    with ThreadPoolExecutor(48) as pool:
        got = list(pool.map(_grab, targets))
    return {f"{h}:{p}": word for (h, p), word in zip(targets, got) if word is not None}
'''

ALICE_VAULT = (
    COMMON
    + r"""
SECRET = "@SECRET@"


@ember.endpoint(
    nodes=2, gang_ports=16, cpu=0.05, memory=128, min_replicas=1, max_replicas=1,
    snapshot=False, scaledown_window=900, node_labels={"vault": "yes"},
)
class Vault:
    @ember.enter()
    def open(self) -> None:
        self.bound = listen(SECRET)

    @ember.method()
    def where(self) -> dict:
        return place()
"""
)

MALLORY_PROBE = (
    COMMON
    + r"""
@ember.endpoint(
    cpu=0.05, memory=256, snapshot=False, scaledown_window=900, node_labels={"side": "h2"}
)
def probe(hosts: list, first: int, last: int) -> dict:
    return scan(hosts, first, last)
"""
)

MALLORY_SPY = (
    COMMON
    + r"""
@ember.endpoint(
    nodes=2, gang_ports=16, cpu=0.05, memory=256, min_replicas=1, max_replicas=1,
    snapshot=False, scaledown_window=900, node_labels={"loop": "yes"},
)
class Spy:
    @ember.method()
    def sweep(self, hosts: list, first: int, last: int) -> dict:
        return {**place(), "found": scan(hosts, first, last)}
"""
)

ALICE_FAR = (
    COMMON
    + r"""
@ember.endpoint(
    nodes=2, gang_ports=16, cpu=0.05, memory=128, snapshot=False, node_labels={"far": "yes"},
)
def far() -> str:
    return "far"
"""
)

MALLORY_HOG = (
    COMMON
    + r"""
@ember.endpoint(
    nodes=2, gang_ports=@EACH@, cpu=0.01, memory=64, min_replicas=@COUNT@,
    max_replicas=@COUNT@, snapshot=False, scaledown_window=900, node_labels={"loop": "yes"},
)
def hog() -> str:
    return "hog"
"""
)

ALICE_LATE = (
    COMMON
    + r"""
@ember.endpoint(
    nodes=2, cpu=0.05, memory=128, min_replicas=1, max_replicas=1, snapshot=False,
    scaledown_window=900, node_labels={"loop": "yes"},
)
def late() -> str:
    return "late"
"""
)

# Its members listen on their gang ports, and when stopped take their exit hook's time
# (within the stop's grace) before they end.
MALLORY_STALE = (
    COMMON
    + r"""
@ember.endpoint(
    nodes=2, gang_ports=4, cpu=0.05, memory=128, min_replicas=0, max_replicas=1,
    snapshot=False, scaledown_window=900, node_labels={"loop": "yes"},
)
class Stale:
    @ember.enter()
    def open(self) -> None:
        self.bound = listen("mallory-stale", last_too=False)

    @ember.method()
    def where(self) -> dict:
        return place()

    @ember.exit()
    def linger(self) -> None:
        time.sleep(15)  # well within the stop's grace (30 s)
"""
)

ALICE_VICTIM = (
    COMMON
    + r"""
SECRET = "@SECRET@"


@ember.endpoint(
    nodes=2, gang_ports=16, cpu=0.05, memory=128, min_replicas=0, max_replicas=1,
    snapshot=False, scaledown_window=900, node_labels={"loop": "yes"},
)
class Victim:
    @ember.enter()
    def open(self) -> None:
        self.bound = listen(SECRET)

    @ember.method()
    def where(self) -> dict:
        return place()
"""
)


# --- the remote node: a network namespace of this machine, routed as a private network


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _in_netns(path: str, make: Any) -> Any:
    """`make()` run in a thread that joined the network namespace at `path`: a socket
    made there stays there."""
    box: dict[str, Any] = {}

    def run() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, os.strerror(errno))
            box["value"] = make()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            os.close(fd)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _pump(source: socket.socket, sink: socket.socket, done: list[int]) -> None:
    """`source`'s bytes to `sink` until either ends; the second pump of a pair to end
    closes both."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        done.append(1)
        if len(done) == 2:
            source.close()
            sink.close()


class Relay:
    """The control plane's port on the remote node's loopback, carried to this machine's."""

    def __init__(self, netns: str, port: int) -> None:
        self.port = port
        self.listener = _in_netns(netns, lambda: socket.create_server(("127.0.0.1", port)))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            done: list[int] = []
            for one, other in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pump, args=(one, other, done), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def _ip(*words: str) -> None:
    subprocess.run(["ip", *words], check=True, capture_output=True, text=True, timeout=10)


@contextlib.contextmanager
def remote_network() -> Iterator[str]:
    """A network namespace, its veth end at REMOTE, this machine's at HOST_SIDE, its
    default route through this machine: the path of the namespace."""
    tag = secrets.token_hex(3)
    name, host_end, remote_end = f"ember-gangs-{tag}", f"egh{tag}", f"egr{tag}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", remote_end)
        _ip("link", "set", remote_end, "netns", name)
        _ip("addr", "add", f"{HOST_SIDE}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("-n", name, "addr", "add", f"{REMOTE}/30", "dev", remote_end)
        _ip("-n", name, "link", "set", remote_end, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "route", "add", "default", "via", HOST_SIDE)
        yield f"/run/netns/{name}"
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def listening_gang_ports() -> list[int]:
    """The platform's gang ports something of this machine listens on (another
    platform's gangs, a bench's): this suite's gangs would collide with them."""
    held = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                port = int(local.rsplit(":", 1)[1], 16)
                if state == "0A" and GANG_PORTS[0] <= port < GANG_PORTS[1]:
                    held.add(port)
    return sorted(held)


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "replicas are sandboxed in networks of their own by root workers")
    if held := listening_gang_ports():
        pytest.fail(f"this machine's gang ports are taken already (another platform?): {held}")
    root = tmp_path_factory.mktemp("gangs")
    # A fixed port: the restart test starts the control plane again where its workers
    # (and the relay) find it.
    with (
        remote_network() as netns,
        running_platform(root / "cp", port=free_port(), extra=("--no-worker",)) as running,
    ):
        assert urlsplit(running.url).hostname in ("127.0.0.1", "localhost"), running.url
        relay = Relay(netns, urlsplit(running.url).port or 443)
        token = running.ember("token", "create", "--scope", "worker").stdout.strip()
        workers = [
            join_worker(
                running,
                token,
                root / "host-1",
                *("--label", "side=h1", "--label", "loop=yes"),
                *("--label", "vault=yes", "--label", "far=yes"),
            ),
            join_worker(
                running,
                token,
                root / "host-2",
                *("--label", "side=h2", "--label", "loop=yes", "--label", "vault=yes"),
            ),
            join_worker(
                running,
                token,
                root / "remote",
                *("--label", "side=remote", "--label", "vault=yes", "--label", "far=yes"),
                netns=netns,
            ),
        ]
        try:
            wait_for(lambda: len(running.status()["workers"]) == 3, 90, interval=0.5)
            yield running
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                try:
                    worker.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
            relay.close()


@pytest.fixture(scope="module")
def tenants(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tenant]:
    folder = tmp_path_factory.mktemp("tenants")
    return {name: Tenant(platform, folder, name) for name in ("alice", "mallory")}


@pytest.fixture(scope="module")
def alice(tenants: dict[str, Tenant]) -> Tenant:
    return tenants["alice"]


@pytest.fixture(scope="module")
def mallory(tenants: dict[str, Tenant]) -> Tenant:
    return tenants["mallory"]


@pytest.fixture(scope="module")
def vault(platform: Platform, alice: Tenant) -> dict[str, Any]:
    """alice's gang on host-1 and host-2 (of the three nodes labelled vault=yes, the two
    sharing a loopback), ready: each member's node, rank, ports."""
    secret = "alice-secret-" + secrets.token_hex(6)
    alice.deploy("vault", ALICE_VAULT.replace("@SECRET@", secret))
    lead = alice.call("vault--vault/where")
    members = wait_for(lambda: _members(platform, alice, "vault--vault", 2), 120, interval=0.5)
    each = int(lead["EMBER_GANG_PORTS"].split("-")[1]) - int(lead["MASTER_PORT"]) + 1
    first = int(lead["MASTER_PORT"])
    ports = {
        row["node"]: (first + row["rank"] * each, first + (row["rank"] + 1) * each - 1)
        for row in members
    }
    assert set(ports) == {"host-1", "host-2"}, members
    return {"secret": secret, "first": first, "end": first + 2 * each, "ports": ports}


@pytest.fixture(scope="module")
def probe(mallory: Tenant) -> Tenant:
    """mallory, its ordinary replica on host-2 (`probe--probe`) deployed once."""
    mallory.deploy("probe", MALLORY_PROBE)
    return mallory


def _members(platform: Platform, tenant: Tenant, label: str, count: int) -> list[dict[str, Any]]:
    """The ready members of `tenant`'s gang `label` (workspace-less), by rank, once there
    are `count` of them; [] before."""
    done = platform.ember_as(tenant.token, "replica", "ls", "--json")
    if done.returncode != 0:
        return []
    rows = [
        row
        for row in json.loads(done.stdout)
        if row["label"].endswith(label) and row["state"] == "ready"
    ]
    return sorted(rows, key=lambda row: row["rank"]) if len(rows) == count else []


def _no_replicas(platform: Platform, tenant: Tenant, app: str) -> bool:
    done = platform.ember_as(tenant.token, "replica", "ls", "--json")
    return done.returncode == 0 and not [
        row for row in json.loads(done.stdout) if f"{app}--" in row["label"]
    ]


def _stop(platform: Platform, tenant: Tenant, app: str) -> None:
    platform.ember_as(tenant.token, "stop", app)
    wait_for(lambda: _no_replicas(platform, tenant, app), 90, interval=0.5)


def _grab(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=3) as sock:
            sock.settimeout(3)
            return sock.recv(300).decode(errors="replace").strip()
    except OSError:
        return None


# --- the control plane's own checks ---------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"nodes": 65},
        {"nodes": 0},
        {"nodes": True},
        {"nodes": "2"},
        {"gang_ports": 1025},
        {"gang_ports": 1},
        {"gang_ports": 2.5},
        {"gang_ports": "32; touch /x"},
    ],
)
def test_the_control_plane_checks_gang_settings_itself(settings: dict[str, Any]) -> None:
    """A hand-made deploy manifest (not the SDK's) with a gang's settings out of range:
    the manifest as the deploy API reads it (api/deploys.py) is refused, before anything
    of it reaches a worker's holder script or pasta's arguments."""
    spec = {
        "name": "e",
        "attribute": "e",
        "kind": "function",
        "settings": {"nodes": 2, **settings},
        "methods": [],
    }
    with pytest.raises(InvalidError):
        EndpointSpec.from_dict(spec)


# --- reach ---------------------------------------------------------------------------


def test_gang_ports_on_the_nodes_loopback_are_out_of_another_workspaces_replicas_reach(
    platform: Platform, alice: Tenant, probe: Tenant, vault: dict[str, Any]
) -> None:
    """mallory's ordinary replica (on host-2) sweeps the platform's gang ports at its
    loopback, and alice's block at the node's addresses: nothing of alice's answers. The
    node itself reaches alice's member on host-1 at its loopback (so it listens there)."""
    first, _ = vault["ports"]["host-1"]
    assert (_grab("127.0.0.1", first) or "").startswith(vault["secret"])  # the node reaches it
    node_addresses = ["192.0.2.2", HOST_SIDE, "127.0.0.2", "::1"]
    found = probe.call("probe--probe", {"hosts": ["127.0.0.1"], "first": 24000, "last": 31999})
    found.update(
        probe.call(
            "probe--probe",
            {"hosts": node_addresses, "first": vault["first"], "last": vault["end"] - 1},
        )
    )
    leaked = {where: word for where, word in found.items() if vault["secret"] in word}
    assert not leaked, f"mallory's replica reached alice's gang: {leaked}"


def test_another_workspaces_gang_member_reaches_nothing_of_a_gang_on_its_machine(
    platform: Platform, alice: Tenant, mallory: Tenant, vault: dict[str, Any]
) -> None:
    """mallory's own gang on host-1 and host-2 (its members forward their peers' ports
    to the node's loopback): its rank 0 sweeps alice's block and its own at its
    loopback, both families. Nothing of alice's answers."""
    mallory.deploy("spy", MALLORY_SPY)
    seen = mallory.call(
        "spy--spy/sweep",
        {"hosts": ["127.0.0.1", "::1"], "first": vault["first"], "last": vault["end"] + 63},
    )
    leaked = {where: word for where, word in seen["found"].items() if vault["secret"] in word}
    assert not leaked, f"mallory's gang member reached alice's gang: {leaked}"


def _member_namespace(address: str, first: int, last: int) -> int:
    """The pid holding the network of the gang member whose pasta takes `first`-`last` in
    at `address` (pasta's last argument)."""
    spec = f"{address}/{first}-{last}"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            words = Path("/proc", entry, "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if words[0].endswith("pasta") and spec in words:
            return int([w for w in words if w][-1])
    raise AssertionError(f"no pasta takes {spec} in")


def _address(hex_address: str) -> str:
    """/proc/net/tcp's `ADDR:PORT` (hex, IPv4 or IPv6, in the host's byte order) as text."""
    address, port = hex_address.rsplit(":", 1)
    raw = bytes.fromhex(address)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def _connections_at(pid: int, first: int, last: int) -> list[str]:
    """The TCP connections (established, or half-open: their SYN answered) at ports
    `first`-`last` in the network namespace of `pid`, as 'port <- peer'."""
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for line in list(lines)[1:]:
                local, peer, state = line.split()[1:4]
                port = int(local.rsplit(":", 1)[1], 16)
                if first <= port <= last and state in ("01", "03"):
                    where = _address(peer)
                    found.append(f"{port} <- {where} ({'half-open' if state == '03' else 'open'})")
    return found


def test_a_gang_is_never_split_over_nodes_that_do_not_share_a_loopback(
    platform: Platform, alice: Tenant, probe: Tenant
) -> None:
    """Nodes on separate machines (here `remote`, in a network of its own): a gang's
    members meet on their machine's loopback, so a gang over host-1 and remote is never
    placed (its deploy is refused, saying why), and no pasta takes gang ports in at
    remote's address, where mallory's ordinary replica on host-2 sweeps them.

    (Found first: with `--gang-address` naming a node's address on the nodes' private
    network, pasta took the gang's ports in there from anyone, and mallory's replica on
    another node reached alice's member's listeners. The address went: gangs stay on
    nodes of one loopback.)"""
    app = alice.folder / alice.workspace / "far" / "app.py"
    app.parent.mkdir(parents=True, exist_ok=True)
    app.write_text(ALICE_FAR)
    done = platform.ember_as(alice.token, "deploy", str(app), "--name", "far")
    assert done.returncode != 0, done.stdout  # refused at deploy, saying why
    assert "cannot_fit" in done.stderr and "they meet on its loopback" in done.stderr, done.stderr
    found = probe.call("probe--probe", {"hosts": [REMOTE], "first": 24000, "last": 24255})
    taken = {where: word for where, word in found.items() if word is not None}
    assert not taken, f"something took gang ports in at the remote node's address: {taken}"


# --- the platform's gang ports ---------------------------------------------------------


def test_one_workspace_cannot_hold_every_gang_port(
    platform: Platform, alice: Tenant, mallory: Tenant, vault: dict[str, Any]
) -> None:
    """mallory tries to fill what is free of the platform's 8000 gang ports with gangs of
    two members (`gang_ports=` up to 1024 each, within its own limits); then alice
    deploys a gang of the default size (32 ports a member). Hers must start.

    (Found first: mallory's four gangs held every port, and alice's never started. A
    workspace's gangs now hold at most 2048 of them: mallory's others wait, saying so.)"""
    _stop(platform, mallory, "spy")
    start, end = GANG_PORTS
    free = (end - start) - (vault["end"] - vault["first"])  # all but alice's vault
    count = -(-free // 2048)
    each = free // (2 * count)
    assert 2 <= each <= 1024 and free - 2 * each * count < 64, (free, count, each)
    hog = MALLORY_HOG.replace("@EACH@", str(each)).replace("@COUNT@", str(count))
    mallory.deploy("hog", hog)
    try:
        wait_for(lambda: _members_of(platform, mallory, "hog--hog") >= 2, 180, 0.5)
        hog_logs = platform.ember_as(mallory.token, "logs", "hog", "-n", "200").stdout
        assert "its workspace's gangs hold" in hog_logs, hog_logs
        assert _members_of(platform, mallory, "hog--hog") == 2  # one gang; the rest wait
        alice.deploy("late", ALICE_LATE)

        def outcome() -> str | None:
            logs = platform.ember_as(alice.token, "logs", "late", "-n", "200").stdout
            if "no room for a gang" in logs:
                return "refused: " + next(
                    line for line in logs.splitlines() if "no room for a gang" in line
                )
            return "ready" if _members_of(platform, alice, "late--late") == 2 else None

        seen = wait_for(outcome, 120, 0.5)
        assert seen == "ready", (
            f"HOLE: mallory's {count} gangs of 2 x {each} ports hold every gang port of the "
            f"platform, and alice's gang cannot start: {seen}"
        )
    finally:
        _stop(platform, mallory, "hog")
        _stop(platform, alice, "late")


def _members_of(platform: Platform, tenant: Tenant, label: str) -> int:
    done = platform.ember_as(tenant.token, "replica", "ls", "--json")
    if done.returncode != 0:
        return 0
    return sum(
        1
        for row in json.loads(done.stdout)
        if row["label"].endswith(label) and row["state"] == "ready"
    )


def test_a_gangs_ports_are_not_given_again_while_old_members_hold_them(
    platform: Platform, alice: Tenant, mallory: Tenant, vault: dict[str, Any]
) -> None:
    """mallory's gang runs (its members listen on its gang ports, and take their stop's
    grace in an exit hook); the control plane restarts (an upgrade). Its members are not
    adopted but stopped, and run on for that grace, their pastas holding the block on
    the node's loopback. alice's new gang must not be handed ports another tenant's
    process still holds: what answers at her MASTER_PORT on the node's loopback (where
    her other rank's pasta takes it) must be hers."""
    _stop(platform, alice, "vault")  # nothing else holds gang ports now
    mallory.deploy("stale", MALLORY_STALE)
    theirs = mallory.call("stale--stale/where")
    wait_for(lambda: _members_of(platform, mallory, "stale--stale") == 2, 120, 0.5)
    secret = "alice-victim-" + secrets.token_hex(6)
    alice.deploy("victim", ALICE_VICTIM.replace("@SECRET@", secret))

    platform.stop()
    platform.start()
    wait_for(lambda: len(platform.status()["workers"]) == 3, 60, interval=0.5)
    mine = alice.call("victim--victim/where")
    port = int(mine["MASTER_PORT"])
    answer = _grab("127.0.0.1", port)
    old = int(theirs["MASTER_PORT"])
    assert answer is not None and answer.startswith(secret), (
        f"HOLE: alice's new gang got ports {mine['EMBER_GANG_PORTS']} (rank 0's) while "
        f"mallory's stopped gang (MASTER_PORT {old}) still held them: her MASTER_PORT on "
        f"the node's loopback answers {answer!r}"
    )
