"""Control-plane scale-out: what 1, 2 and 3 `ember server` processes on one PostgreSQL
carry, each held to the same CPU quota (issue 51, item 5).

One platform: a throwaway PostgreSQL (tests/postgres_cluster.py), one S3 API (moto, in
this process), one worker, and 12 apps of one class endpoint each (a no-op method and a
method streaming 50 events), one replica each. The processes join one after another;
with each count, the load generator (a process of its own, keep-alive HTTP/1.1 on
asyncio streams and uvloop) spreads its connections over every process and every app:

- **calls**: 32 connections in closed loops of no-op calls; calls/s;
- **streams**: 16 connections in closed loops of streamed calls; events (chunks)/s;
- **through another process** (2 and 3 processes): a no-op call at concurrency 1 to one
  app, through the process that serves its calls and through one that does not,
  alternating rounds; the P50 added;
- **a kill** (with 3 processes): `kill -9` of the process that serves the apps while
  spawned calls (with idempotency keys) go on through every process; the time until
  each app answers through another process, and the spawned calls lost.

Every control-plane process is held to `--cpu` CPUs (0.5 by default) by a cgroup's CPU
quota, so that the load generator, the worker and its replicas have the rest of the
machine. Printed: each count's calls/s and events/s and their ratio to one process's,
each process's CPU per call, and the verdicts against the reach: 3 processes carry
>= 2.5x the calls/s and the events/s of one, a call through a process that does not
serve its app adds <= 0.2 ms at P50, and after the kill every app answers within 5 s
with no spawned call lost.

    .venv/bin/python bench/scaleout.py           # about three minutes
    .venv/bin/python bench/scaleout.py --json
    .venv/bin/python bench/scaleout.py --quick   # 1 s windows, 2 apps

A run that fails part-way prints what the counts before measured, and which failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

REACH_RATIO = 2.5  # 3 processes against 1, calls and events alike
REACH_ADDED_P50_MS = 0.2
REACH_RECOVERY_S = 5.0  # every app answers again after a kill; nothing spawned lost
PROCESSES = 3
BUCKET = "ember-scaleout-bench"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SHARED_FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "admin-token")
EVENTS_PER_STREAM = 50
CLIENT_TIMEOUT_S = 30.0

APP_SOURCE = """\
import ember


@ember.endpoint(min_replicas=1, max_replicas=1, concurrency=64, cpu=0.1)
class Api:
    @ember.method
    async def noop(self) -> dict:
        return {}

    @ember.method
    async def events(self, n: int = 50):
        for i in range(n):
            yield i
"""


# ===================================================================================
# The load generator's process.
# ===================================================================================


class Connection:
    """One keep-alive HTTP/1.1 connection, one pre-built request, answered in full."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.request = request

    @classmethod
    async def open(cls, target: dict[str, Any], token: str, context: ssl.SSLContext) -> Connection:
        reader, writer = await asyncio.open_connection(
            target["host"], target["port"], ssl=context, server_hostname=target["host"]
        )
        body = target["body"].encode()
        request = (
            f"POST {target['path']} HTTP/1.1\r\nHost: {target['host']}:{target['port']}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        return cls(reader, writer, request)

    async def call(self) -> tuple[float, int]:
        """(seconds, events): a JSON answer is one, a stream counts its events."""
        start = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if head[9:12] != b"200":
            raise RuntimeError(f"answered {head[:200]!r}")
        length = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
        if length is not None:
            await self.reader.readexactly(int(length.group(1)))
            return time.perf_counter() - start, 1
        events = 0
        while True:  # chunked: a chunk's size line, the chunk, its CRLF; 0 ends it
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            events += chunk.count(b"data: ")
        return time.perf_counter() - start, events

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def closed_loops(spec: dict[str, Any]) -> dict[str, Any]:
    """`len(targets)` connections, each calling its target in a closed loop; what ends
    within the window counted."""
    context = ssl.create_default_context(cafile=spec["ca"])
    pool = [await Connection.open(t, spec["token"], context) for t in spec["targets"]]
    counting = stop = False
    counted = {"calls": 0, "events": 0}
    latencies: list[float] = []

    async def loop(connection: Connection) -> None:
        while not stop:
            seconds, events = await connection.call()
            if counting:
                counted["calls"] += 1
                counted["events"] += events
                latencies.append(seconds)

    tasks = [asyncio.ensure_future(loop(c)) for c in pool]
    try:
        await asyncio.sleep(spec["warmup"])
        cpu_before = {pid: _cpu_seconds(int(pid)) for pid in spec["pids"]}
        began = time.perf_counter()
        counting = True
        await asyncio.sleep(spec["duration"])
        counting = False
        seconds = time.perf_counter() - began
        cpu = {pid: _cpu_seconds(int(pid)) - before for pid, before in cpu_before.items()}
        stop = True
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            await asyncio.gather(*tasks)
    finally:
        stop = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in pool), return_exceptions=True)
    latencies.sort()
    return {
        **counted,
        "seconds": seconds,
        "cpu": cpu,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
    }


async def one_at_a_time(spec: dict[str, Any]) -> dict[str, list[float]]:
    """Each target in turn, rounds alternating, one call at a time: latencies in ms."""
    context = ssl.create_default_context(cafile=spec["ca"])
    out: dict[str, list[float]] = {t["name"]: [] for t in spec["targets"]}
    for number in range(spec["rounds"]):
        order = spec["targets"] if number % 2 == 0 else spec["targets"][::-1]
        for target in order:
            connection = await Connection.open(target, spec["token"], context)
            try:
                for _ in range(20):  # warm: the connection and both ends' paths
                    await connection.call()
                for _ in range(spec["requests"]):
                    out[target["name"]].append(1000 * (await connection.call())[0])
            finally:
                await connection.close()
    return out


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_main() -> int:
    spec = json.load(sys.stdin)
    work = closed_loops(spec) if spec["kind"] == "loops" else one_at_a_time(spec)
    try:
        import uvloop

        result = uvloop.run(work)
    except ImportError:
        result = asyncio.run(work)
    print(json.dumps(result), flush=True)
    return 0


def run_client(spec: dict[str, Any]) -> Any:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--client-process"],
        input=json.dumps(spec).encode(),
        capture_output=True,
        timeout=spec.get("duration", 0) + spec.get("warmup", 0) + 300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed: {done.stderr.decode()[-2000:]}")
    return json.loads(done.stdout)


# ===================================================================================
# The platform: processes, their CPU quota, the worker, the apps.
# ===================================================================================


class Quota:
    """A cgroup of the worker's helpers per control-plane process, at `cpus` CPUs."""

    def __init__(self, cpus: float) -> None:
        from ember_worker.processes.cgroups import CPU, find_tree

        self.tree = find_tree()
        problem = self.tree.problem(CPU)
        if problem is not None:
            raise RuntimeError(f"cannot hold the processes to a CPU quota: {problem}")
        self.cpus = cpus
        self.groups: list[Any] = []

    def hold(self, name: str, pid: int) -> None:
        group = self.tree.create(name, cpu_limit=self.cpus)
        self.groups.append(group)
        for procs in group.procs_files:
            procs.write_text(str(pid))

    def remove(self) -> None:
        for group in self.groups:
            group.remove()


class Fleet:
    """Up to three processes of one platform, each in its quota, and one worker."""

    def __init__(self, root: Path, database: str, s3: str, quota: Quota) -> None:
        from harness import free_port  # type: ignore[import-not-found]

        self.root = root
        self.quota = quota
        self.extra = (
            "--no-worker", "--database", database, "--blob-store", f"s3://{BUCKET}/ember",
            "--blob-s3-endpoint-url", s3,
        )  # fmt: skip
        self.urls = [f"https://127.0.0.1:{free_port()}" for _ in range(PROCESSES)]
        self.processes: list[Any] = []
        self.worker: subprocess.Popen[bytes] | None = None

    def add(self) -> None:
        from harness import Platform

        index = len(self.processes)
        state = self.root / f"cp{index}" / "state"
        if index:
            state.mkdir(parents=True, mode=0o700)
            for name in SHARED_FILES:
                shutil.copy2(self.root / "cp0" / "state" / name, state / name)
        port = int(self.urls[index].rsplit(":", 1)[1])
        process = Platform(self.root / f"cp{index}", port=port, extra=self.extra, env=AWS_ENV)
        self.processes.append(process.start())
        self.quota.hold(f"scaleout-cp{index}", process.process.pid)

    @property
    def first(self) -> Any:
        return self.processes[0]

    @property
    def token(self) -> str:
        return (self.root / "cp0" / "state" / "admin-token").read_text().strip()

    def join_worker(self) -> None:
        token = self.first.ember("token", "create", "--scope", "worker").stdout.strip()
        command = [
            sys.executable, "-m", "ember.cli.main", "worker", "--server", ",".join(self.urls),
            "--token", token, "--ca-cert", self.first.ca, "--work-dir", str(self.root / "node"),
            "--name", "node",
        ]  # fmt: skip
        with (self.root / "node.log").open("w") as log:
            self.worker = subprocess.Popen(
                command, env=self.first.env, stdout=subprocess.DEVNULL, stderr=log
            )

    def serving(self, app: str) -> int:
        """The process that serves `app`'s calls: today, the platform lease's holder."""
        import psycopg

        database = self.extra[self.extra.index("--database") + 1]
        with psycopg.connect(database, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder_url FROM leases WHERE name = 'platform' "
                "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
            ).fetchone()
        if row is None:
            raise RuntimeError("nobody owns the platform")
        return self.urls.index(str(row[0]))

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.terminate()
            try:
                self.worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        for process in reversed(self.processes):
            process.stop()


def target(url: str, app: str, method: str, body: str, name: str = "") -> dict[str, Any]:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    path = f"/{app}--api/{method}"
    return {"name": name, "host": host, "port": int(port), "path": path, "body": body}


def measure(fleet: Fleet, apps: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One count of processes: its calls/s, events/s and CPU per call."""
    live = fleet.urls[: len(fleet.processes)]
    pids = [str(p.process.pid) for p in fleet.processes]
    base = {"token": fleet.token, "ca": fleet.first.ca, "pids": pids, "kind": "loops"}
    base |= {"warmup": args.warmup, "duration": args.duration}
    calls = [target(live[i % len(live)], apps[i % len(apps)], "noop", "{}") for i in range(32)]
    events_body = json.dumps({"n": EVENTS_PER_STREAM})
    streams = [
        target(live[i % len(live)], apps[i % len(apps)], "events", events_body) for i in range(16)
    ]
    row: dict[str, Any] = {"processes": len(live)}
    found = run_client({**base, "targets": calls})
    row["calls_per_s"] = found["calls"] / found["seconds"]
    row["calls_p50_ms"] = found["p50_ms"]
    row["cpu_us_per_call"] = [1e6 * found["cpu"][pid] / max(1, found["calls"]) for pid in pids]
    found = run_client({**base, "targets": streams})
    row["events_per_s"] = found["events"] / found["seconds"]
    row["cpu_us_per_event"] = [1e6 * found["cpu"][pid] / max(1, found["events"]) for pid in pids]
    if len(live) > 1:
        serving = fleet.serving(apps[0])
        other = (serving + 1) % len(live)
        spec = {
            **base,
            "kind": "sequential",
            "rounds": args.rounds,
            "requests": args.requests,
            "targets": [
                target(live[serving], apps[0], "noop", "{}", "serving"),
                target(live[other], apps[0], "noop", "{}", "other"),
            ],
        }
        latencies = run_client(spec)
        p50 = {name: statistics.median(values) for name, values in latencies.items()}
        row["through_other_added_p50_ms"] = p50["other"] - p50["serving"]
        row["serving_p50_ms"] = p50["serving"]
    return row


class SpawnLoad:
    """Spawned no-op calls with idempotency keys, over every app and every process's URL
    (the SDK moves along the list), one thread, until stopped; each collected at the end."""

    def __init__(self, fleet: Fleet, apps: list[str]) -> None:
        import ember
        from ember.config import ClientConfig

        urls = tuple(fleet.urls[: len(fleet.processes)])
        config = ClientConfig(urls[0], fleet.token, fleet.first.ca, server_urls=urls)
        self.calls = [ember.Endpoint.lookup(app, "api", config=config).noop for app in apps]
        self.spawned: list[Any] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spawn)

    def __enter__(self) -> SpawnLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _spawn(self) -> None:
        number = 0
        while not self._stop.is_set():
            call = self.calls[number % len(self.calls)]
            number += 1
            try:
                self.spawned.append(call.spawn(_idempotency_key=f"scaleout-{os.getpid()}-{number}"))
            except Exception as error:  # a spawn not accepted is no call lost, but said
                self.errors.append(f"{type(error).__name__}: {error}")
            self._stop.wait(0.02)

    def lost(self) -> int:
        lost = 0
        for handle in self.spawned:
            try:
                if handle.get(timeout=120) != {}:
                    lost += 1
            except Exception:
                lost += 1
        return lost


def first_answers(fleet: Fleet, apps: list[str], through: int, killed_at: float) -> list[float]:
    """Seconds from the kill until each app's no-op answers through process `through`."""
    import httpx

    answers: list[float] = []

    def ask(app: str) -> None:
        with httpx.Client(
            base_url=fleet.urls[through],
            verify=fleet.first.ca,
            headers={"Authorization": f"Bearer {fleet.token}"},
            timeout=30,
        ) as client:
            while time.monotonic() - killed_at < CLIENT_TIMEOUT_S:
                with contextlib.suppress(httpx.HTTPError):
                    if client.post(f"/{app}--api/noop", json={}).status_code == 200:
                        answers.append(time.monotonic() - killed_at)
                        return
                time.sleep(0.02)
        answers.append(float("inf"))

    threads = [threading.Thread(target=ask, args=(app,)) for app in apps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=CLIENT_TIMEOUT_S + 30)
    return sorted(answers)


def kill_under_load(fleet: Fleet, apps: list[str]) -> dict[str, Any]:
    """`kill -9` of the process that serves the apps, while spawned calls go on through
    every process: how long until each app answers through another, and what was lost."""
    victim = fleet.serving(apps[0])
    with SpawnLoad(fleet, apps) as load:
        wait_for_spawns(load, 20)
        os.killpg(fleet.processes[victim].process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        answers = first_answers(fleet, apps, (victim + 1) % len(fleet.processes), killed_at)
        wait_for_spawns(load, len(load.spawned) + 20)
    return {
        "answered_p50_s": statistics.median(answers),
        "answered_max_s": answers[-1],
        "spawned": len(load.spawned),
        "lost": load.lost(),
        "spawn_errors": load.errors[:5],
    }


def wait_for_spawns(load: SpawnLoad, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(load.spawned) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import boto3
    from harness import wait_for
    from moto.server import ThreadedMotoServer
    from postgres_cluster import start_cluster  # type: ignore[import-not-found]

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's line per request
    result["failed"] = {"part": "starting the platform", "error": ""}
    root = Path(tempfile.mkdtemp(prefix="ember-scaleout-bench-"))
    quota = Quota(args.cpu)
    cluster = start_cluster()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    s3 = f"http://{host}:{port}"
    boto3.client(
        "s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)  # fmt: skip
    fleet = Fleet(root, cluster.new_database(), s3, quota)
    result["setup"] = {"cpu_per_process": args.cpu, "apps": args.apps}
    rows: list[dict[str, Any]] = result.setdefault("counts", [])
    try:
        progress(f"starting one process, a worker and {args.apps} apps")
        fleet.add()
        fleet.join_worker()
        wait_for(lambda: len(fleet.first.status()["workers"]) == 1, 60)
        source = root / "app" / "app.py"
        source.parent.mkdir()
        source.write_text(APP_SOURCE)
        apps = [f"scale{i}" for i in range(args.apps)]
        for app in apps:
            fleet.first.deploy(source, app)
        wait_for(lambda: _ready(fleet) >= len(apps), 180)
        for count in range(1, args.processes + 1):
            if count > 1:
                result["failed"]["part"] = f"starting process {count}"
                fleet.add()
            result["failed"]["part"] = f"{count} processes"
            progress(f"{count} process{'es' if count > 1 else ''}: calls, streams, latency")
            rows.append(measure(fleet, apps, args))
        if args.processes > 1:
            result["failed"]["part"] = "the kill"
            progress("kill -9 of the serving process under spawned calls")
            result["kill"] = kill_under_load(fleet, apps)
        del result["failed"]
    finally:
        fleet.stop()
        quota.remove()
        moto.stop()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _ready(fleet: Fleet) -> int:
    with fleet.first.client() as client:
        rows = client.get("/v1/apps").json()["endpoints"]
    return sum(1 for row in rows if row["replicas"].get("ready", 0) >= 1)


def progress(text: str) -> None:
    print(f"[scaleout] {text}", file=sys.stderr, flush=True)


def verdicts(result: dict[str, Any]) -> dict[str, bool | None]:
    rows = {row["processes"]: row for row in result.get("counts", [])}
    one, three = rows.get(1), rows.get(PROCESSES)
    found: dict[str, bool | None] = {
        "calls": None,
        "events": None,
        "through_other": None,
        "kill": None,
    }
    kill = result.get("kill")
    if kill:
        found["kill"] = kill["answered_max_s"] <= REACH_RECOVERY_S and kill["lost"] == 0
    if one and three:
        found["calls"] = three["calls_per_s"] / one["calls_per_s"] >= REACH_RATIO
        found["events"] = three["events_per_s"] / one["events_per_s"] >= REACH_RATIO
    added = [r["through_other_added_p50_ms"] for r in rows.values() if r["processes"] > 1]
    if added:
        found["through_other"] = max(added) <= REACH_ADDED_P50_MS
    return found


def mark(passed: bool | None) -> str:
    return "not measured" if passed is None else ("PASS" if passed else "MISS")


def report(result: dict[str, Any]) -> str:
    setup = result.get("setup", {})
    lines = [
        "control-plane scale-out: 1 to 3 processes on one PostgreSQL, "
        f"each held to {setup.get('cpu_per_process', '?')} CPU; {setup.get('apps', '?')} apps",
        "",
        f"{'processes':<10}{'calls/s':>9}{'ratio':>7}{'events/s':>10}{'ratio':>7}"
        f"{'added P50 (ms)':>16}  control-plane CPU per call (us), by process",
    ]
    rows = result.get("counts", [])
    one = rows[0] if rows else None
    for row in rows:
        calls_ratio = row["calls_per_s"] / one["calls_per_s"] if one else 0.0
        events_ratio = row["events_per_s"] / one["events_per_s"] if one else 0.0
        added = row.get("through_other_added_p50_ms")
        shown = f"{added:+.2f}" if added is not None else "-"
        cpu = ", ".join(f"{us:.0f}" for us in row["cpu_us_per_call"])
        lines.append(
            f"{row['processes']:<10}{row['calls_per_s']:>9,.0f}{calls_ratio:>6.2f}x"
            f"{row['events_per_s']:>10,.0f}{events_ratio:>6.2f}x{shown:>16}  {cpu}"
        )
    found = result.get("verdicts", {})
    lines += [
        "",
        f"calls/s, 3 processes against 1 (reach >= {REACH_RATIO}x): {mark(found.get('calls'))}",
        f"events/s, 3 processes against 1 (reach >= {REACH_RATIO}x): {mark(found.get('events'))}",
        "added P50 through a process that does not serve the app (reach <= "
        f"{REACH_ADDED_P50_MS} ms): {mark(found.get('through_other'))}",
    ]
    kill = result.get("kill")
    if kill:
        lines.append(
            f"kill -9 of the serving process: every app answered again within "
            f"{kill['answered_max_s']:.2f} s (P50 {kill['answered_p50_s']:.2f} s), "
            f"{kill['lost']} of {kill['spawned']} spawned calls lost (reach <= "
            f"{REACH_RECOVERY_S:g} s, none lost): {mark(found.get('kill'))}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error "
        "(with --quick: 0 once every verdict is printed).",
    )
    parser.add_argument("--cpu", type=float, default=0.5, help="CPUs per process (0.5)")
    parser.add_argument(
        "--processes", type=int, default=PROCESSES, choices=range(1, PROCESSES + 1),
        help=f"up to this many processes ({PROCESSES})",
    )  # fmt: skip
    parser.add_argument("--apps", type=int, help="apps, one replica each (12; quick 2)")
    parser.add_argument("--duration", type=float, help="s measured per load (5; quick 1)")
    parser.add_argument("--warmup", type=float, help="s before each window (2; quick 0.5)")
    parser.add_argument("--rounds", type=int, help="latency rounds per process (4; quick 1)")
    parser.add_argument("--requests", type=int, help="calls per latency round (300; quick 50)")
    parser.add_argument("--quick", action="store_true", help="short windows: verdicts shown")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--client-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {
        "apps": (12, 2),
        "duration": (5.0, 1.0),
        "warmup": (2.0, 0.5),
        "rounds": (4, 1),
        "requests": (300, 50),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_process:
        return client_main()
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; the platform's processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the counts before measured is printed all the same
        failed = result.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(error).__name__}: {error}"
    result["verdicts"] = verdicts(result)
    print(json.dumps(result, indent=2) if args.json else report(result))
    if "failed" in result:
        failed = result["failed"]
        print(f"scaleout bench: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    if args.quick:
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
