"""What the replica sandbox costs: a hello endpoint's cold start, restore and calls, with
the sandbox and without it (`ember server --no-sandbox`), side by side in one run.

Two platforms side by side, each with the same file deployed twice: app `cold`
(snapshot=False: every start boots cold) and app `snap` (its first replica is
checkpointed, later ones restore the image). Each round waits for scale-to-zero, then
calls each app once: the request-to-answer time of a start from zero; each round
measures both platforms, in turn. Then a warm replica of each answers `--calls` calls,
alternating: the per-call time. Both platforms run as
root with the same replica uids and PID namespaces; only the mount namespace, seccomp
filter and egress rule differ.

Egress: each platform's replica downloads `--download-mb` (1 GB by default) over HTTP,
in turn, from a server on the node's loopback (the port opened to replicas with
`--replica-loopback-port`: through pasta's forwarding for a sandboxed replica, which
has a network of its own) and from a server in a network namespace of the bench's own
behind a veth pair (the internet, as the node routes to it: through pasta's sockets).
Throughput with the sandbox against without it, the median of `--downloads` tries.

Reach (issues 34 and 48): the sandbox, its network included, adds at most 100 ms to a
cold start, 50 ms to a restore (issue 34 asked 20 ms before networks) and 0.1 ms to a
warm call (medians); a sandboxed replica downloads at 80 % of the node's own speed.

    .venv/bin/python bench/sandbox.py            # about a minute on 2 CPUs
    .venv/bin/python bench/sandbox.py --quick    # 1 round, 5 calls, one 50 MB download each
    .venv/bin/python bench/sandbox.py --json
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from procs import Parts, ServerProcess, isolated_env, progress, server_url, stopped_at_exit

from ember.calling.tlsclient import client_context

REACH_COLD_S = 0.100
REACH_RESTORE_S = 0.050
REACH_CALL_S = 0.0001
REACH_EGRESS = 0.80
APPS = ("cold", "snap")
SIDES = ("on", "off")  # with the sandbox, without it
NAMES = {"on": "sandbox", "off": "no sandbox"}
ZERO_TIMEOUT_S = 120.0
SNAPSHOT_TIMEOUT_S = 180.0
HELLO = """\
import ember


@ember.endpoint(snapshot={snapshot}, scaledown_window=1, max_replicas=1)
class Hello:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.greeting = "hello"

    @ember.method
    def hi(self) -> str:
        return self.greeting
"""


DOWNLOAD = """\
import socket
import time

import ember


@ember.endpoint(snapshot=False, scaledown_window=600, max_replicas=1, timeout=600)
def download(host: str, port: int) -> dict:
    began = time.perf_counter()
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(b"GET / HTTP/1.1\\r\\nHost: bench\\r\\n\\r\\n")
        buffer = memoryview(bytearray(1 << 20))
        total = 0
        while got := sock.recv_into(buffer):
            total += got
    return {"bytes": total, "seconds": time.perf_counter() - began}
"""
# An HTTP server that answers every connection with SIZE bytes of zeros, then closes it.
SERVER = """\
import socket, sys, threading
size, host = int(sys.argv[1]), sys.argv[2]
server = socket.create_server((host, 0))
print(server.getsockname()[1], flush=True)
chunk = bytes(1 << 20)
def answer(conn):
    with conn:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % size)
        left = size
        while left > 0:
            conn.sendall(chunk[: min(left, len(chunk))])
            left -= len(chunk)
while True:
    conn, _ = server.accept()
    threading.Thread(target=answer, args=(conn,), daemon=True).start()
"""


@contextlib.contextmanager
def http_server(size: int, host: str, netns: str | None = None) -> Iterator[int]:
    """SERVER on `host` (in network namespace `netns` where given): its port."""
    command = [sys.executable, "-c", SERVER, str(size), host]
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        yield int(server.stdout.readline())
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def outside_network() -> Iterator[tuple[str, str]]:
    """A network namespace behind a veth pair routed from the node, as the internet is:
    (its name, its address)."""
    tag = secrets.token_hex(3)
    netns, veth = f"bench-{tag}", f"vbench{tag}"
    steps = [
        ["ip", "netns", "add", netns],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", "far", "netns", netns],
        ["ip", "addr", "add", "10.232.7.1/30", "dev", veth],
        ["ip", "link", "set", veth, "up"],
        ["ip", "-n", netns, "addr", "add", "10.232.7.2/30", "dev", "far"],
        ["ip", "-n", netns, "link", "set", "far", "up"],
        ["ip", "-n", netns, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield netns, "10.232.7.2"
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


class Platform:
    def __init__(self, server: ServerProcess, url: str, state: Path) -> None:
        self.server = server
        self.client = httpx.Client(
            base_url=url,
            verify=client_context(str(state / "ca.pem")),
            headers={"Authorization": f"Bearer {(state / 'admin-token').read_text().strip()}"},
            timeout=300,
        )

    def rows(self) -> dict[str, dict[str, Any]]:
        rows = self.client.get("/v1/apps").raise_for_status().json()["endpoints"]
        return {row["label"]: row for row in rows}

    def wait_for_zero(self) -> None:
        deadline = time.monotonic() + ZERO_TIMEOUT_S
        while any(any(r["replicas"].values()) for r in self.rows().values()):
            self.server.remember()
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not scale to zero")
            time.sleep(0.1)

    def wait_for_snapshot(self) -> None:
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while not self.rows()["snap--hello"]["snapshots"]:
            self.server.remember()
            if time.monotonic() > deadline:
                raise RuntimeError("no snapshot of snap--hello:\n" + self.server.tail())
            time.sleep(0.1)

    def download(self, host: str, port: int) -> float:
        """Bytes a second the replica of app `net` read from host:port."""
        answer = self.client.post("/net--download/", json={"host": host, "port": port})
        if answer.status_code != 200:
            raise RuntimeError(f"download: HTTP {answer.status_code} {answer.text[:300]}")
        done = answer.json()
        return float(done["bytes"]) / float(done["seconds"])

    def call(self, app: str) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        answer = self.client.post(f"/{app}--hello/hi", json={})
        seconds = time.perf_counter() - started
        if answer.status_code != 200 or answer.json() != "hello":
            raise RuntimeError(f"{app}: HTTP {answer.status_code} {answer.text[:300]}")
        return seconds, dict(self.rows()[f"{app}--hello"].get("last_start") or {})


def start(work: Path, sandbox: bool, started: list[ServerProcess], opened: int) -> Platform:
    """An `ember server` (with or without the sandbox) with the apps deployed, and the
    snap app's image taken; the node's loopback port `opened` open to replicas."""
    env = isolated_env(work)
    state = work / "state"
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    command += ["--port", "0", *([] if sandbox else ["--no-sandbox"])]
    command += ["--replica-loopback-port", str(opened)]
    server = ServerProcess.start("ember server", command, work / "server.log", env)
    started.append(server)
    platform = Platform(server, server_url(server, 60), state)
    for app in (*APPS, "net"):
        source = work / app / "app.py"
        source.parent.mkdir()
        source.write_text(DOWNLOAD if app == "net" else HELLO.format(snapshot=app == "snap"))
        deploy = [sys.executable, "-m", "ember.cli.main", "deploy", str(source)]
        done = subprocess.run(
            [*deploy, "--name", app, "--wait"], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"deploy {app}: {done.stderr}")
    platform.call("snap")  # the first replica boots cold and is checkpointed
    platform.wait_for_snapshot()
    return platform


def measure(
    folder: Path, args: argparse.Namespace, parts: Parts, runs: dict[str, dict[str, Any]]
) -> None:
    """Both platforms up at once; each round measures both, in turn (the order swapped
    every round), so that a change in the machine's load weighs on both alike. `runs`
    fills as the parts go."""
    size, quiet = args.download_mb * 1_000_000, args.quiet
    with (
        stopped_at_exit() as started,
        outside_network() as (netns, address),
        http_server(size, "127.0.0.1") as loopback_port,
        http_server(size, address, netns) as outside_port,
    ):
        platforms = {}
        for side in SIDES:
            parts.now = f"starting the platform {NAMES[side]}"
            (folder / side).mkdir()
            platforms[side] = start(folder / side, side == "on", started, loopback_port)
        for index in range(args.rounds):
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            for side in order:
                parts.now = f"round {index + 1} of starts from zero, {NAMES[side]}"
                platform, result = platforms[side], runs[side]
                platform.wait_for_zero()
                cold, _ = platform.call("cold")
                result["cold"].append(cold)
                platform.wait_for_zero()
                restored, last = platform.call("snap")
                result["restore"].append(restored)
                result["kinds"].append(last.get("kind"))
                timing = f"cold {cold:.3f} s, restore {restored:.3f} s"
                progress(quiet, f"round {index + 1}, {NAMES[side]}: {timing}")
        parts.now = "the warm calls"
        for side in SIDES:
            platforms[side].call("cold")  # warm
        for _ in range(args.calls):
            for side in SIDES:
                runs[side]["call"].append(platforms[side].call("cold")[0])
        for index in range(args.downloads):
            for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                for where, host, port in (
                    ("loopback", "127.0.0.1", loopback_port),
                    ("outside", address, outside_port),
                ):
                    parts.now = f"download {index + 1} ({where}), {NAMES[side]}"
                    speed = platforms[side].download(host, port)
                    runs[side][where].append(speed)
                    progress(
                        quiet,
                        f"download {index + 1}, {NAMES[side]}, {where}: {speed / 1e9:.2f} GB/s",
                    )


def verdict(ok: bool) -> str:
    return "within reach" if ok else "OUT OF REACH"


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians of what each side measured; the added time, the ratios and the verdicts
    of what both did."""
    med = {
        (side, what): statistics.median(runs[side][what])
        for side in runs
        for what in ("cold", "restore", "call")
        if runs[side][what]
    }
    both = [w for w in ("cold", "restore", "call") if ("on", w) in med and ("off", w) in med]
    added = {what: med[("on", what)] - med[("off", what)] for what in both}
    speeds = {
        (side, where): statistics.median(runs[side][where])
        for side in runs
        for where in ("loopback", "outside")
        if runs[side][where]
    }
    egress = {
        where: speeds[("on", where)] / speeds[("off", where)]
        for where in ("loopback", "outside")
        if ("on", where) in speeds and ("off", where) in speeds
    }
    reach = {"cold": REACH_COLD_S, "restore": REACH_RESTORE_S, "call": REACH_CALL_S}
    return {
        "medians_s": {f"{side} {what}": value for (side, what), value in med.items()},
        "added_s": added,
        "ratios": {what: med[("on", what)] / med[("off", what)] for what in added},
        "download_bytes_per_s": {f"{side} {where}": v for (side, where), v in speeds.items()},
        "egress_ratios": egress,
        "within_reach": {
            **{what: value <= reach[what] for what, value in added.items()},
            **{f"egress {where}": ratio >= REACH_EGRESS for where, ratio in egress.items()},
        },
        "runs": runs,
    }


def report(summary: dict[str, Any]) -> str:
    medians, added = summary["medians_s"], summary["added_s"]
    speeds, egress = summary["download_bytes_per_s"], summary["egress_ratios"]

    def cell(value: float | None, width: int, form: str, unit: str = "") -> str:
        return " " * (width + len(unit)) if value is None else f"{value:>{width}{form}}{unit}"

    lines = [f"{'':24}{'sandbox':>10}{'no sandbox':>12}{'added':>10}{'ratio':>8}"]
    for what, title in (("cold", "cold start"), ("restore", "restore"), ("call", "warm call")):
        on, off = medians.get(f"on {what}"), medians.get(f"off {what}")
        if on is None and off is None:
            continue
        ms = {k: None if v is None else v * 1000 for k, v in (("on", on), ("off", off))}
        lines.append(
            f"{title + ' (median)':24}{cell(ms['on'], 8, '.1f', 'ms')}"
            f"{cell(ms['off'], 10, '.1f', 'ms')}"
            f"{cell(None if what not in added else added[what] * 1000, 8, '.1f', 'ms')}"
            f"{cell(summary['ratios'].get(what), 8, '.2f')}"
        )
    for where, title in (("loopback", "node loopback port"), ("outside", "outside (veth)")):
        on, off = speeds.get(f"on {where}"), speeds.get(f"off {where}")
        if on is None and off is None:
            continue
        gb = {k: None if v is None else v / 1e9 for k, v in (("on", on), ("off", off))}
        lines.append(
            f"{'download, ' + title:24}{cell(gb['on'], 6, '.2f', 'GB/s')}"
            f"{cell(gb['off'], 8, '.2f', 'GB/s')}{'':>10}{cell(egress.get(where), 8, '.2f')}"
        )
    reach = summary["within_reach"]
    for what, line in (
        ("cold", "cold start: sandbox adds <= 100 ms"),
        ("restore", "restore: sandbox adds <= 50 ms"),
        ("call", "warm call: sandbox adds <= 0.1 ms"),
        ("egress loopback", "download (loopback): >= 80 % of the node's own"),
        ("egress outside", "download (outside): >= 80 % of the node's own"),
    ):
        if what in reach:
            lines.append(f"{line}: {verdict(reach[what])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="starts from zero (5; quick 1)")
    parser.add_argument("--calls", type=int, default=None, help="warm calls (50; quick 5)")
    parser.add_argument(
        "--downloads", type=int, default=None, help="downloads of each (3; quick 1)"
    )
    parser.add_argument(
        "--download-mb", type=int, default=None, help="MB a download (1000; quick 50)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 5 calls, one 50 MB download each"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    sizes = {"rounds": (5, 1), "calls": (50, 5), "downloads": (3, 1), "download_mb": (1000, 50)}
    for name, (full, quick) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    runs: dict[str, dict[str, Any]] = {
        side: {"cold": [], "restore": [], "kinds": [], "call": [], "loopback": [], "outside": []}
        for side in SIDES
    }
    parts = Parts("bench/sandbox.py")
    failed = None
    try:
        with tempfile.TemporaryDirectory(prefix="ember-bench-sandbox-") as folder:
            measure(Path(folder), args, parts, runs)
    except Exception as error:
        failed = error
    if any(kind != "restore" for kind in runs["on"]["kinds"] + runs["off"]["kinds"]):
        print(f"warning: not every snap start was a restore: {runs}", file=sys.stderr)
    return 2 if parts.show(summarize(runs), failed, args.json, report) else 0


if __name__ == "__main__":
    sys.exit(main())
