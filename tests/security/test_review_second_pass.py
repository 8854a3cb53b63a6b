"""A second pass over the replicas' channel socket file, spare networks and the snapshot
phase's reach (issue 48's second round), by a tenant holding a deploy token of its own
workspace against a real `ember server` whose replicas are sandboxed. Each test is the
tenant's action from its replica (or its snapshot phase, uid 0 where CRIU lacks
CAP_SYS_RESOURCE) and an outcome seen on the node.

Found:

- the control plane's replica socket (`<state dir>/replica-channels.sock`, mounted at
  `/ember/channel.sock` in every sandbox) is served by a uvicorn of the channels alone
  (`http/channels.py` `channel_server`), without the HTTPS gateway's limits
  (`https_server.limited_protocol`): a connection that never sends its head is never
  closed, and a head is never bounded. So a replica holds as many idle connections as
  it likes (the gateway closes them after head_timeout_seconds), makes the control
  plane (root, outside every sandbox) keep a head of any number of headers in its
  memory (the gateway answers 431 past max_headers / max_head_bytes) (both fail today).

Held: the mounted socket (and its folder) cannot be chmod-ed, chown-ed, replaced,
unlinked or bound over, by the replica or by its snapshot phase as uid 0 with CAP_CHOWN;
the socket answers no worker channel, no other replica's channel and no API route
without their tokens; a replica's flood of connections to the socket (it stops at some
2,300, its connects answered EAGAIN) leaves the control plane answering another
tenant, whose new replica still opens its channel there; the snapshot phase writes
none of its cgroups' files (limits, procs) and mounts no cgroup file system; a replica
that fails to start again and again leaves no pasta, holder or pasta cgroup of its
network uid behind beyond one spare.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Platform, running_platform, wait_for
from machine_needs import need
from test_network import Tenant

PROBE_APP = r'''
import errno
import fcntl
import os
import resource
import socket
import stat
import struct
import time

import ember

SOCK = "/ember/channel.sock"
NS_GET_USERNS, NS_GET_OWNER_UID = 0xB701, 0xB704
HELD = []


def attempt(action):
    try:
        done = action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "done" if done is None else done


def net_owner():
    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        users = fcntl.ioctl(fd, NS_GET_USERNS)
    finally:
        os.close(fd)
    try:
        return struct.unpack("I", fcntl.ioctl(users, NS_GET_OWNER_UID, b"\0" * 4))[0]
    finally:
        os.close(users)


def _bind_over():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(SOCK)
    finally:
        sock.close()


def _replace():
    with open("/tmp/evil-sock", "w") as f:
        f.write("x")
    os.rename("/tmp/evil-sock", SOCK)


def tamper():
    """Every change a process might try on the mounted socket and its folder."""
    st = os.lstat(SOCK)
    out = {
        "uid": os.getuid(),
        "before": [stat.filemode(st.st_mode), st.st_uid, st.st_ino],
        "chmod": attempt(lambda: os.chmod(SOCK, 0o600)),
        "chown": attempt(lambda: os.chown(SOCK, os.getuid(), os.getgid())),
        "chown_root": attempt(lambda: os.chown(SOCK, 0, 0)),
        "utime": attempt(lambda: os.utime(SOCK, (0, 0))),
        "setxattr": attempt(lambda: os.setxattr(SOCK, "user.evil", b"1")),
        "unlink": attempt(lambda: os.unlink(SOCK)),
        "rename_away": attempt(lambda: os.rename(SOCK, "/tmp/moved")),
        "replace": attempt(_replace),
        "bind_over": attempt(_bind_over),
        "folder_create": attempt(lambda: open("/ember/evil", "w").close()),
        "folder_chmod": attempt(lambda: os.chmod("/ember", 0o777)),
        "open_write": attempt(lambda: os.close(os.open(SOCK, os.O_WRONLY))),
    }
    st = os.lstat(SOCK)
    out["after"] = [stat.filemode(st.st_mode), st.st_uid, st.st_ino]
    return out


def cgroup_writes():
    """Writes to every file of its own cgroups it can see, and a cgroup mount."""
    out = {}
    for top, _, files in os.walk("/sys/fs/cgroup"):
        for name in files:
            if name in (
                "cgroup.procs", "tasks", "memory.limit_in_bytes", "memory.max",
                "memory.kmem.tcp.limit_in_bytes", "memory.memsw.limit_in_bytes",
                "pids.max", "cpu.cfs_quota_us", "cpu.max", "cgroup.subtree_control",
                "notify_on_release", "release_agent",
            ):
                path = os.path.join(top, name)
                value = str(os.getpid()) if name in ("cgroup.procs", "tasks") else "max"
                if name.endswith("limit_in_bytes"):
                    value = "-1"
                out[path] = attempt(lambda: open(path, "w").write(value) and None)
                out[path + " chown"] = attempt(lambda: os.chown(path, os.getuid(), -1))
    os.makedirs("/tmp/cg", exist_ok=True)
    out["mount"] = attempt(lambda: _mount("cgroup", "/tmp/cg", "cgroup", "memory"))
    out["mount2"] = attempt(lambda: _mount("cgroup2", "/tmp/cg", "cgroup2", ""))
    return out


def _mount(source, target, kind, data):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), kind.encode(), 0, data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _talk(request, seconds=10):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(seconds)
    try:
        sock.connect(SOCK)
        sock.sendall(request)
        got = b""
        while b"\r\n" not in got:
            chunk = sock.recv(500)
            if not chunk:
                break
            got += chunk
        return got.split(b"\r\n")[0].decode(errors="replace") or "closed"
    except OSError as exc:
        return type(exc).__name__
    finally:
        sock.close()


def _upgrade(path, token=None):
    head = (
        f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n"
    )
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    return (head + "\r\n").encode()


@ember.endpoint(scaledown_window=300, snapshot=False)
def sock_tamper() -> dict:
    return tamper()


@ember.endpoint(scaledown_window=300, snapshot=False)
def channels() -> dict:
    """What the socket answers a replica without the tokens of what it asks for."""
    token = os.environ.get("EMBER_TOKEN", "")
    return {
        "worker_none": _talk(_upgrade("/v1/workers/channel")),
        "worker_bogus": _talk(_upgrade("/v1/workers/channel", "ember_w_bogus")),
        "worker_env": _talk(_upgrade("/v1/workers/channel", token)),
        "replica_other": _talk(_upgrade("/v1/replicas/r-0000000000/channel", "bogus")),
        "api": _talk(b"GET /v1/apps HTTP/1.1\r\nHost: localhost\r\n\r\n"),
        "api_post": _talk(
            b"POST /v1/workspaces HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}"
        ),
    }


@ember.endpoint(scaledown_window=300, snapshot=False)
def idle(count: int, seconds: float) -> dict:
    """`count` connections that send part of a head and then nothing for `seconds`:
    how many the server closed meanwhile."""
    held = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(SOCK)
        sock.sendall(b"GET /v1/workers/channel HTTP/1.1\r\nHost: localhost\r\n")
        held.append(sock)
    time.sleep(seconds)
    closed = 0
    for sock in held:
        sock.setblocking(False)
        try:
            if sock.recv(1000, socket.MSG_PEEK) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    return {"count": count, "closed": closed}


@ember.endpoint(scaledown_window=300, snapshot=False)
def header_flood(headers: int) -> dict:
    """One head of `headers` headers, never ended, its connection held (until drop)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(SOCK)
    sent = 0
    outcome = "sent"
    try:
        sock.sendall(b"GET /v1/workers/channel HTTP/1.1\r\nHost: localhost\r\n")
        batch = 20000
        while sent < headers:
            chunk = b"".join(b"x-%d: y\r\n" % (sent + i) for i in range(batch))
            sock.sendall(chunk)
            sent += batch
    except OSError as exc:
        outcome = type(exc).__name__
    HELD.append(sock)
    return {"sent": sent, "outcome": outcome}


@ember.endpoint(scaledown_window=300, snapshot=False)
def drop() -> int:
    n = len(HELD)
    for sock in HELD:
        sock.close()
    HELD.clear()
    return n


@ember.endpoint(scaledown_window=300, snapshot=False)
def flood(count: int, seconds: float, stop: str = "") -> dict:
    """`count` connections to the socket, held `seconds` or until the file `stop`
    appears, by as many children as their descriptor limit asks for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    each = max(1, hard - 64)
    pipes = []
    left = count
    while left > 0:
        mine = min(each, left)
        left -= mine
        read, write = os.pipe()
        if os.fork() == 0:
            os.close(read)
            held = []
            misses = 0
            why = "none"
            end = time.monotonic() + min(seconds / 2, 20)
            while len(held) < mine and misses < 20 and time.monotonic() < end:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(2)
                try:
                    sock.connect(SOCK)
                except OSError as exc:
                    sock.close()
                    misses += 1
                    why = errno.errorcode.get(exc.errno, str(exc))
                    continue
                held.append(sock)
            os.write(write, b"%d %s\n" % (len(held), why.encode()))
            end = time.monotonic() + seconds
            while time.monotonic() < end and not (stop and os.path.exists(stop)):
                time.sleep(0.1)
            os._exit(0)
        os.close(write)
        pipes.append(read)
    opened = 0
    whys = []
    for read in pipes:
        got = os.read(read, 100).split() or [b"0", b"-"]
        opened += int(got[0])
        whys.append(got[1].decode())
    for _ in pipes:
        with __import__("contextlib").suppress(ChildProcessError):
            os.wait()
    return {"opened": opened, "hard": hard, "why": whys}


@ember.endpoint(scaledown_window=300, snapshot=False)
def whoami() -> dict:
    return {"uid": os.getuid(), "net_owner": attempt(net_owner)}


@ember.endpoint(name="snapper", scaledown_window=300)
class Snapper:
    @ember.enter(snap=True)
    def phase(self) -> None:
        self.uid = os.getuid()
        self.caps = next(
            l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")
        )
        self.tamper = tamper()
        self.cgroups = cgroup_writes()

    @ember.method
    def report(self) -> dict:
        return {"uid": self.uid, "caps": self.caps, "tamper": self.tamper,
                "cgroups": self.cgroups}
'''

CRASHING_APP = """\
import ember


@ember.endpoint(scaledown_window=300, snapshot=False)
class Crash:
    @ember.enter()
    def boom(self) -> None:
        raise RuntimeError("fails every start")

    @ember.method
    def run(self) -> str:
        return "never"
"""

VICTIM_APP = """\
import ember


@ember.endpoint(scaledown_window=300, snapshot=False)
def hello() -> str:
    return "hi"


@ember.endpoint(scaledown_window=300, snapshot=False)
def fresh() -> str:
    return "fresh"
"""

# The HTTPS gateway's defaults (platform/ember_platform/config.py): what one client may
# hold of it, which a replica must not get past through its socket file either.
HEAD_TIMEOUT_SECONDS = 10.0
MAX_HEADERS = 100


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        need("root", "replicas are sandboxed, each in a network of its own, by a root worker")
    with running_platform(tmp_path_factory.mktemp("review-second-pass")) as running:
        yield running


@pytest.fixture(scope="module")
def mallory(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    tenant = Tenant(platform, tmp_path_factory.mktemp("tenants"), "mallory")
    tenant.deploy("probe", PROBE_APP)
    return tenant


@pytest.fixture(scope="module")
def victim(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    tenant = Tenant(platform, tmp_path_factory.mktemp("victims"), "victim")
    tenant.deploy("app", VICTIM_APP)
    assert tenant.call("app--hello") == "hi"
    return tenant


def _call(tenant: Tenant, path: str, body: dict[str, Any] | None = None) -> Any:
    with tenant.platform.client(tenant.token, timeout=300) as client:
        answer = client.post(f"/{tenant.workspace}--{path}", json=body or {})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _server_pid(platform: Platform) -> int:
    assert platform.process is not None
    return platform.process.pid


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return 0


def _socket_file(platform: Platform) -> os.stat_result:
    return os.lstat(platform.state_dir / "replica-channels.sock")


# --- the socket file ------------------------------------------------------------------


def test_a_replica_cannot_change_the_mounted_channel_socket(
    platform: Platform, mallory: Tenant, victim: Tenant
) -> None:
    """chmod, chown, utime, xattr, unlink, rename, a file renamed over it, a socket bound
    over it, a file beside it: all refused to the replica, the node's socket unchanged
    and still serving another tenant's replicas."""
    before = _socket_file(platform)
    seen = _call(mallory, "probe--sock-tamper")
    after = _socket_file(platform)
    changed = {k: v for k, v in seen.items() if v == "done"}
    assert not changed, f"the replica (uid {seen['uid']}) changed the mounted socket: {seen}"
    assert seen["before"] == seen["after"], seen
    assert (after.st_mode, after.st_uid, after.st_ino) == (
        before.st_mode,
        before.st_uid,
        before.st_ino,
    )
    assert stat.S_ISSOCK(after.st_mode) and after.st_uid == 0
    assert victim.call("app--hello") == "hi"


def test_the_snapshot_phase_cannot_change_the_socket_nor_its_cgroups(
    platform: Platform, mallory: Tenant, victim: Tenant
) -> None:
    """The snapshot phase (uid 0 with CAP_CHOWN where CRIU lacks CAP_SYS_RESOURCE): the
    same changes to the mounted socket, and writes to its cgroups' files (its limits,
    moving itself), a chown of them, a cgroup mount."""
    before = _socket_file(platform)
    seen = _call(mallory, "probe--snapper/report")
    after = _socket_file(platform)
    tamper = {k: v for k, v in seen["tamper"].items() if v == "done"}
    assert not tamper, f"the snapshot phase (uid {seen['uid']}) changed the socket: {seen}"
    written = {k: v for k, v in seen["cgroups"].items() if v == "done"}
    assert not written, f"the snapshot phase (uid {seen['uid']}) wrote its cgroups: {written}"
    assert len(seen["cgroups"]) > 2, f"no cgroup file seen: {seen['cgroups']}"
    assert (after.st_mode, after.st_uid, after.st_ino) == (
        before.st_mode,
        before.st_uid,
        before.st_ino,
    )
    assert victim.call("app--hello") == "hi"


def test_the_socket_opens_no_channel_without_its_token(mallory: Tenant) -> None:
    """The worker channel (no token, a made-up one, whatever the replica's environment
    holds), another replica's channel, and the API: refused or not served there."""
    seen = _call(mallory, "probe--channels")
    for name in ("worker_none", "worker_bogus", "worker_env", "replica_other"):
        assert not seen[name].startswith("HTTP/1.1 101"), f"{name} upgraded: {seen}"
    for name in ("api", "api_post"):
        assert seen[name].startswith("HTTP/1.1 404") or "closed" in seen[name], seen


# --- the socket's server: the gateway's limits ------------------------------------------


def test_idle_connections_to_the_channel_socket_are_closed(mallory: Tenant) -> None:
    """Connections that never finish their head: the HTTPS gateway aborts them after
    head_timeout_seconds (10 s); on the replicas' socket they stay open for ever, so a
    replica holds as many of the control plane's descriptors as it likes (fails today)."""
    seen = _call(mallory, "probe--idle", {"count": 40, "seconds": HEAD_TIMEOUT_SECONDS + 6})
    assert seen["closed"] == seen["count"], (
        f"the control plane kept {seen['count'] - seen['closed']} of {seen['count']} "
        f"connections from a replica open for {HEAD_TIMEOUT_SECONDS + 6} s without a head"
    )


def test_a_head_on_the_channel_socket_is_bounded(platform: Platform, mallory: Tenant) -> None:
    """One head of 400,000 tiny headers (some 5 MB sent), never ended: the HTTPS gateway
    answers 431 past 100 headers or 64 KiB; the replicas' socket parses and keeps them
    all in the control plane's memory (root's, in no limit of the tenant's) (fails
    today: some 60 MiB more for one connection)."""
    pid = _server_pid(platform)
    before = _rss_kib(pid)
    try:
        seen = _call(mallory, "probe--header-flood", {"headers": 400_000})
        time.sleep(1)
        grown_mib = (_rss_kib(pid) - before) / 1024
    finally:
        _call(mallory, "probe--drop")
    assert seen["outcome"] != "sent" or grown_mib < 16, (
        f"the control plane took a head of {seen['sent']} headers from a replica "
        f"({seen['outcome']}) and grew by {grown_mib:.0f} MiB"
    )


def test_a_replica_cannot_take_the_control_planes_descriptors(
    platform: Platform, mallory: Tenant, victim: Tenant, replica_writable: Path
) -> None:
    """The replica opens as many connections to its socket as the control plane may have
    descriptors and holds them: another tenant's replica that starts meanwhile must
    still open its channel there and answer (held: the flood stops at some 2,300
    connections, the replica's connects answered EAGAIN, though nothing of the
    gateway's max_connections bounds the socket)."""
    pid = _server_pid(platform)
    limit = _nofile(pid)
    assert victim.call("app--hello") == "hi"
    result: dict[str, Any] = {}
    hold = 120.0  # at most: the flood ends once the other tenant has had its answer
    stop = replica_writable / "flood-may-stop"

    def run() -> None:
        try:
            body = {"count": limit, "seconds": hold, "stop": str(stop)}
            result["seen"] = _call(mallory, "probe--flood", body)
        except BaseException as exc:
            result["error"] = repr(exc)

    flooding = threading.Thread(target=run, daemon=True)
    flooding.start()
    try:
        # Until the replica has opened all it could (the count stops growing).
        counts = [_fds(pid)]
        while flooding.is_alive() and len(counts) < 50:
            time.sleep(0.5)
            counts.append(_fds(pid))
            if len(counts) > 12 and counts[-1] == counts[-12] and counts[-1] > counts[0] + 100:
                break
        held = counts[-1]
        outcome = "answered"
        try:
            # A replica of the other tenant's that starts now: its channel opens over
            # the same socket.
            with victim.platform.client(victim.token, timeout=25) as client:
                answer = client.post(f"/{victim.workspace}--app--fresh/", json={})
            if answer.status_code != 200:
                outcome = f"status {answer.status_code}: {answer.text[:200]}"
        except httpx.HTTPError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        # Still held while the other tenant was answered (or not).
        still_flooding = flooding.is_alive()
    finally:
        stop.touch()
        flooding.join(hold + 120)
    assert outcome == "answered", (
        f"with {held} of its {limit} descriptors held by one replica's connections to its "
        f"socket, the control plane did not answer another tenant: {outcome} "
        f"(the replica's flood: {result})"
    )
    assert still_flooding, f"the flood ended before the other tenant's call: {result}"
    wait_for(lambda: _fds(pid) < limit // 2, 60, 0.5)
    assert victim.call("app--hello") == "hi"


# --- spare networks ------------------------------------------------------------------


def _network_processes() -> dict[int, list[str]]:
    """The node's processes of the network uids (pasta, holders), by uid."""
    found: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        state = fields.get("State", "").strip()[:1]
        if 500_000 <= uid < 500_000 + 65_537 and state not in ("Z", "X"):
            found.setdefault(uid, []).append(f"{entry}:{fields['Name'].strip()}")
    return found


def _net_cgroups(uid: int) -> list[str]:
    found = []
    for top, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(top, d) for d in dirs if d.startswith(f"net-{uid}-")]
        if top.count("/") > 8:
            dirs.clear()
    return found


def test_failed_starts_leave_no_network_behind(
    platform: Platform, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A tenant whose replica fails every start (its enter raises): each start takes a
    namespace (its spare, or a new one) and makes a spare; what is left of its network
    uid once they have failed must be one spare at most (a holder and a pasta), not one
    per start, nor their pasta cgroups."""
    crasher = Tenant(platform, tmp_path_factory.mktemp("crasher"), "crasher")
    crasher.deploy("crash", CRASHING_APP)
    before = _network_processes()
    # Six failed starts: a call fails after three (the controller's backoffs of 1 s and
    # 2 s between them), and a new version starts the count again, where a fourth start
    # of the same version would first wait out 4 s, a fifth 8 s, a sixth 16 s.
    for version in (1, 2):
        if version > 1:
            crasher.deploy("crash", CRASHING_APP + f"# version {version}\n")
        with platform.client(crasher.token, timeout=120) as client:
            answer = client.post("/crasher--crash--crash/run", json={})
        assert answer.status_code != 200, answer.text
    logs = platform.ember_as(crasher.token, "logs", "crash/crash", "-n", "1000").stdout
    assert logs.count("replica failed to start") >= 6, logs
    time.sleep(4)
    after = _network_processes()
    new_uids = set(after) - set(before)
    assert len(new_uids) <= 1, f"several new network uids: {new_uids}"
    for uid in new_uids:
        held = after[uid]
        groups = _net_cgroups(uid)
        assert len(held) <= 2, f"network uid {uid} keeps {held} after failed starts"
        hierarchies = {Path(g).parent.parent for g in groups} or {None}
        assert len(groups) <= len(hierarchies), f"pasta cgroups left: {groups}"
