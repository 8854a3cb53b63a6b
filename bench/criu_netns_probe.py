"""Whether CRIU dumps a process that holds TCP sockets in a network namespace of its own,
and restores that image twice side by side, each copy into a fresh network namespace.

    sudo .venv/bin/python bench/criu_netns_probe.py                # a few seconds, as root
    sudo .venv/bin/python bench/criu_netns_probe.py --quick        # the same: it is quick
    sudo .venv/bin/python bench/criu_netns_probe.py --network-lock skip --json

A small Python server runs in a new network namespace (lo up) and a new PID namespace:
it listens on 127.0.0.1:PORT, holds one established loopback connection to its own
listener (both ends), and answers one line per connection: `echo X`, `pair X` (X sent
through the held connection one way, reversed and sent back the other) and `who` (a
token drawn at its start, its pid, how many requests it has served).

It is dumped through pycriu's RPC (`criu swrk`, as ember_worker.snapshots drives it) and
left running, its network namespace external to the image (`external`
"net[<inode>]:<key>") and its TCP connections kept (`tcp_established`). The image is then
restored twice, each copy as a child of this script (`rst_sibling`) into a new network
namespace of its own with lo up, handed in for the key (`inherit_fd`). Each copy, and the
original, is asked from inside its namespace: a new connection echoes, the held
connection carries data both ways, and `who` shows the original's token and count.

CRIU 4.1.1 on Linux >= 6.16 fails the dump ("Can't get 1:16 opt"): the kernel refuses
SO_PASSCRED/SO_PASSSEC on TCP sockets. infra/criu/patches/socket-passcred.patch fixes it.

What a restore needs (seen on Linux 6.18): lo up in the new namespace before the restore
(else "Can't connect inet socket back: Network is unreachable") and every address the
sockets are bound to ("Can't bind inet socket: Cannot assign requested address");
`tcp_established` at the restore too. `--network-lock`: iptables (CRIU's default) drops
the source namespace's traffic while the tree is frozen; at a restore into an external
namespace CRIU installs no lock, and its unlock there fails harmlessly (two
iptables-restore error lines). skip leaves both out (about 50 ms less frozen, 40 ms less
per restore). nftables needs a CRIU built with libnftables, which infra/criu.sh's is not.

Exit status 0 when every check passes, 1 when one fails, 2 on an error (what the probe
got to before it printed, then the part that failed and CRIU's error lines).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from procs import Parts

DEFAULT_CRIU = "/usr/local/sbin/criu"  # where infra/criu.sh installs it
NETWORK_KEY = "probe-network"
LOG_LEVEL = 4  # everything: a probe's log is read when something fails

# The dumped process: its own session (CRIU dumps a whole session), a listener, one held
# connection to it, then one request per accepted connection, blocking, single-threaded.
SERVER = """
import os, socket, sys
os.setsid()
port = int(sys.argv[1])
token = os.urandom(4).hex()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(16)
near = socket.create_connection(("127.0.0.1", port))
far, _ = listener.accept()

def exactly(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data

served = 0
while True:
    conn, _ = listener.accept()
    with conn:
        line = b""
        while not line.endswith(b"\\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            line += chunk
        verb, _, arg = line.decode().strip().partition(" ")
        served += 1
        if verb == "echo":
            reply = arg
        elif verb == "pair":
            near.sendall(arg.encode())
            there = exactly(far, len(arg.encode()))
            far.sendall(there[::-1])
            back = exactly(near, len(there))
            reply = there.decode() + " " + back.decode()
        elif verb == "who":
            reply = f"{token} pid={os.getpid()} served={served}"
        else:
            reply = "?"
        conn.sendall((reply + "\\n").encode())
"""

# One request from inside a network namespace (run under nsenter): the reply line.
CLIENT = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as conn:
    conn.sendall((sys.argv[2] + "\\n").encode())
    reply = b""
    while chunk := conn.recv(4096):
        reply += chunk
print(reply.decode().strip())
"""


class ProbeError(RuntimeError):
    pass


class SwrkChannel:
    """How pycriu reaches `criu swrk`: started with subprocess, handed the descriptors a
    restore inherits (pycriu calls only connect and disconnect)."""

    def __init__(self, binary: str, pass_fds: Sequence[int] = ()) -> None:
        self.binary = binary
        self.pass_fds = tuple(pass_fds)
        self.process: subprocess.Popen[bytes] | None = None
        self.socket: socket.socket | None = None

    def connect(self, daemon: bool) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [self.binary, "swrk", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(), *self.pass_fds),
            )
        finally:
            theirs.close()
        self.socket = ours
        return ours

    def disconnect(self) -> None:
        if self.socket is not None:
            self.socket.close()
        if self.process is not None:
            self.process.wait()


def criu_call(binary: str, pass_fds: Sequence[int] = ()) -> Any:
    import pycriu

    call = pycriu.criu()
    call._comm = SwrkChannel(binary, pass_fds)
    return call


def error_lines(log: Path, limit: int = 12) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [line for line in lines if "Error" in line or "FAILED" in line]
    return "\n".join((errors or lines)[-limit:])


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Namespaces:
    """Named network namespaces (`ip netns`), lo up in each, deleted at the end."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.names: list[str] = []

    def add(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        ip("netns", "add", name)
        self.names.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    def delete_all(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def ns_path(name: str) -> str:
    return f"/run/netns/{name}"


def in_network(name: str) -> list[str]:
    """A command prefix that runs a command in network namespace `name` (only that: the
    mount namespace stays the node's, so CRIU has no mounts to dump)."""
    return ["nsenter", f"--net={ns_path(name)}"]


def ask(name: str, port: int, request: str) -> str:
    """One request to 127.0.0.1:`port` from inside network namespace `name`."""
    done = subprocess.run(
        [*in_network(name), sys.executable, "-I", "-c", CLIENT, str(port), request],
        capture_output=True,
        text=True,
        timeout=15,
    )
    if done.returncode:
        raise ProbeError(f"{request!r} in {name}: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def start_server(name: str, port: int) -> tuple[subprocess.Popen[bytes], int]:
    """The server in network namespace `name` and a new PID namespace: the launcher
    (nsenter, then unshare, waiting) and the server's pid on the node."""
    server = [sys.executable, "-I", "-c", SERVER, str(port)]
    launcher = subprocess.Popen(
        [*in_network(name), "unshare", "--pid", "--fork", *server],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
    )
    deadline = time.monotonic() + 10
    while True:
        if launcher.poll() is not None:
            raise ProbeError(f"the server exited with {launcher.returncode}")
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
        with contextlib.suppress(OSError):
            pids = children.read_text().split()
            if pids:
                with contextlib.suppress(ProbeError):
                    ask(name, port, "echo ready")
                    return launcher, int(pids[0])
        if time.monotonic() > deadline:
            raise ProbeError("the server did not answer within 10 s")
        time.sleep(0.05)


def lock_method(name: str) -> int:
    import pycriu

    return int(
        {"iptables": pycriu.rpc.IPTABLES, "nftables": pycriu.rpc.NFTABLES}.get(
            name, pycriu.rpc.SKIP
        )
    )


def dump(binary: str, pid: int, images: Path, network_lock: str) -> float:
    import pycriu

    netns = os.stat(f"/proc/{pid}/ns/net").st_ino
    call = criu_call(binary)
    images_fd = os.open(images, os.O_DIRECTORY)
    try:
        opts = call.opts
        opts.images_dir_fd = images_fd
        opts.log_file = "dump.log"
        opts.log_level = LOG_LEVEL
        opts.pid = pid
        opts.leave_running = True
        opts.shell_job = False
        opts.tcp_established = True
        opts.network_lock = lock_method(network_lock)
        opts.external.append(f"net[{netns}]:{NETWORK_KEY}")
        started = time.perf_counter()
        try:
            call.dump()
        except pycriu.CRIUException as exc:
            raise ProbeError(f"dump: {exc}\n{error_lines(images / 'dump.log')}") from None
        return time.perf_counter() - started
    finally:
        os.close(images_fd)


def restore(
    binary: str, images: Path, work: Path, name: str, network_lock: str
) -> tuple[int, float]:
    """Restore `images` into network namespace `name`: the restored pid and the seconds."""
    import pycriu

    netns_fd = os.open(ns_path(name), os.O_RDONLY)
    images_fd = os.open(images, os.O_DIRECTORY)
    work_fd = os.open(work, os.O_DIRECTORY)
    try:
        call = criu_call(binary, pass_fds=(netns_fd,))
        opts = call.opts
        opts.images_dir_fd = images_fd
        opts.work_dir_fd = work_fd
        opts.log_file = "restore.log"
        opts.log_level = LOG_LEVEL
        opts.rst_sibling = True  # our child: reaped here
        opts.shell_job = False
        opts.tcp_established = True
        opts.network_lock = lock_method(network_lock)
        entry = opts.inherit_fd.add()
        entry.key, entry.fd = NETWORK_KEY, netns_fd
        started = time.perf_counter()
        try:
            response = call.restore()
        except pycriu.CRIUException as exc:
            raise ProbeError(f"restore: {exc}\n{error_lines(work / 'restore.log')}") from None
        return int(response.pid), time.perf_counter() - started
    finally:
        for fd in (netns_fd, images_fd, work_fd):
            os.close(fd)


def checks(name: str, port: int, token: str, served: int) -> dict[str, Any]:
    """What one copy (or the original) answers from inside its namespace: each check's
    verdict, and the replies."""
    word = f"hello-{name.rpartition('-')[2]}"
    replies = {
        "echo": ask(name, port, f"echo {word}"),
        "pair": ask(name, port, "pair abc123"),
        "who": ask(name, port, "who"),
    }
    return {
        "echo": replies["echo"] == word,
        "held connection": replies["pair"] == "abc123 321cba",
        "same state": replies["who"].split()[0::2] == [token, f"served={served}"],
        "replies": replies,
    }


def criu_stat(path: Path, kind: str, field: str) -> float:
    """One figure, in seconds, from the stats file CRIU writes beside an image or in a
    restore's work dir."""
    import pycriu

    with path.open("rb") as handle:
        return int(pycriu.images.load(handle)["entries"][0][kind][field]) / 1e6


@contextlib.contextmanager
def cleanup(namespaces: Namespaces, pids: list[int], work: Path, keep: bool) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        namespaces.delete_all()
        if keep:
            print(f"images and logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, parts: Parts, result: dict[str, Any]) -> None:
    """Fill `result` as the probe goes: the dump's figures, each copy as it is restored,
    then every check."""
    if os.geteuid() != 0:
        raise ProbeError("run it as root: CRIU and network namespaces need it")
    namespaces = Namespaces(f"ember-probe-{os.getpid()}")
    work = Path(tempfile.mkdtemp(prefix="ember-criu-netns-"))
    pids: list[int] = []
    result.update(criu=args.criu, network_lock=args.network_lock)
    with cleanup(namespaces, pids, work, args.keep):
        parts.now = "the server's start"
        source = namespaces.add("src")
        launcher, server = start_server(source, args.port)
        pids.append(server)
        token = ask(source, args.port, "who").split()[0]
        images = work / "images"
        images.mkdir()
        parts.now = "the dump"
        result["dump_seconds"] = dump(args.criu, server, images, args.network_lock)
        result["frozen_seconds"] = criu_stat(images / "stats-dump", "dump", "frozen_time")
        result["image_bytes"] = sum(p.stat().st_size for p in images.iterdir())
        # The original answered `echo ready` (maybe more than once) and `who` before it
        # was dumped: the copies' next `who` is their third request from here on.
        served = int(ask(source, args.port, "who").split()[2].split("=")[1])
        copies: dict[str, dict[str, Any]] = {}
        result["copies"] = copies
        for number in (1, 2):
            parts.now = f"restore {number}"
            name = namespaces.add(f"r{number}")
            rst_work = work / f"restore-{number}"
            rst_work.mkdir()
            pid, seconds = restore(args.criu, images, rst_work, name, args.network_lock)
            pids.append(pid)
            copies[name] = {
                "pid": pid,
                "restore_seconds": seconds,
                "criu_restore_seconds": criu_stat(
                    rst_work / "stats-restore", "restore", "restore_time"
                ),
            }
        for name, copy in copies.items():
            parts.now = f"the checks of {name}"
            # Each copy was dumped at `served - 1`: echo, pair, then who.
            copy["checks"] = checks(name, args.port, token, served + 2)
        parts.now = "the checks of the original"
        original = checks(source, args.port, token, served + 3)
        result["original"] = {"pid": server, "checks": original}
        result["ok"] = all(
            passed
            for c in [result["original"], *copies.values()]
            for check, passed in c["checks"].items()
            if check != "replies"
        )
        if args.keep:
            result["work"] = str(work)
        launcher.kill()
        launcher.wait()


def verdicts(checked: dict[str, Any]) -> str:
    marks = [f"{k} {'ok' if v else 'FAILED'}" for k, v in checked.items() if k != "replies"]
    return ", ".join(marks) + f" ({checked['replies']['who']})"


def report(result: dict[str, Any]) -> str:
    """Whatever the probe got to: a failed one stops before its last lines."""
    lines = [f"criu {result['criu']}, network_lock {result['network_lock']}"]
    if "image_bytes" in result:
        lines.append(
            f"dump (leave_running): {result['dump_seconds'] * 1000:.0f} ms, frozen "
            f"{result['frozen_seconds'] * 1000:.0f} ms, image {result['image_bytes'] / 1e6:.1f} MB"
        )
    for name, copy in result.get("copies", {}).items():
        checked = verdicts(copy["checks"]) if "checks" in copy else "not checked"
        lines.append(
            f"restore into {name}: {copy['restore_seconds'] * 1000:.0f} ms "
            f"(CRIU {copy['criu_restore_seconds'] * 1000:.0f} ms), pid {copy['pid']}: " + checked
        )
    if "original" in result:
        lines.append("original, still running: " + verdicts(result["original"]["checks"]))
    if "ok" in result:
        lines.append("all checks pass" if result["ok"] else "SOME CHECKS FAILED")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench/criu_netns_probe.py",
        description="Dump a process holding TCP sockets in its own network namespace with "
        "CRIU, restore it twice side by side into fresh namespaces, and check each copy's "
        "listener and held connection. Needs root and CRIU.",
    )
    parser.add_argument("--criu", default=DEFAULT_CRIU, help="the criu binary")
    parser.add_argument("--port", type=int, default=8765, help="the server's port")
    parser.add_argument(
        "--network-lock",
        choices=("iptables", "nftables", "skip"),
        default="iptables",
        help="how CRIU keeps the connections quiet during the dump and restore",
    )
    parser.add_argument("--keep", action="store_true", help="keep the images and logs")
    parser.add_argument("--quick", action="store_true", help="the same probe (it is quick)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    parts = Parts("bench/criu_netns_probe.py")
    result: dict[str, Any] = {}
    failed = None
    try:
        run(args, parts, result)
    except Exception as error:
        failed = error
    if parts.show(result, failed, args.json, report):
        return 2
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
