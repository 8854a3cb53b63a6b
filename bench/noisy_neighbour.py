"""Noisy neighbours: one workspace's calls, alone and while another workspace floods the
platform, and the memory of the control plane and its local worker meanwhile.

One `ember server` with two workspaces, each deploying with a deploy token of its own.
`victim` has a no-op endpoint (`min_replicas=1`, snapshots off); a separate process calls
it at a fixed rate (`--rate`, 20 calls/s) on one kept connection, one call after another
on a fixed schedule, each call's latency counted from its due time (a stall delays the
calls behind it, and counts in theirs too); any answer but 200 is an error. `noisy`
does, one phase each, while the victim is called:

- baseline: nothing;
- large results: 8 callers x 3 calls (`--large-calls`) to an endpoint returning a 60 MB
  string;
- log flood: one call of an endpoint printing 1 KB lines as fast as it can for the phase;
- queue flood: 8 callers each spawning `--spawns` (300) calls (`Prefer: respond-async`)
  at a 50 ms endpoint (concurrency 8, 2 replicas at most); 202s and 429s are counted,
  then every accepted call is waited for (`GET /v1/calls/{id}?wait=...`): none may be
  lost or fail;
- connection burst: `--connections` (1,000) connections opened at once with the noisy
  token, each making one call to a no-op; the answers counted by status.

A phase lasts `--seconds` (10; `--quick`: 4), or as long as its attack takes if longer
(the queue flood until its last accepted call is done). Every 50 ms a thread sums the
RSS of the control plane and its local worker (`python -m ember_worker`); the peak of
each phase is compared with the baseline phase's.

Reach (issue 49): under any attack, the victim's p99 <= 3x its p99 alone and never over
100 ms; no error for the victim; peak memory <= the baseline's + 512 MiB; the noisy
workspace loses no spawned call it was told was accepted.

The noisy workspace's own clients (decrypting its 60 MB results, opening its 1,000
connections) run in this process; on a real platform they run on the tenant's machines.
While an attack runs, this process is held to `--attacker-cpus` (1) of this machine's
CPUs by a cgroup's CPU quota, at the lowest CPU weight (it runs on what the platform
leaves), so that what the victim loses is the platform's doing, not the load
generator's; `--attacker-cpus 0` leaves it unconfined. The victim's caller, the server,
its worker and every replica stay outside that cgroup. (At a process's weight the
clients decrypting 60 MB results took the CPU the victim's replica waited for: its
p99 under large results was 20 to 30 ms, 14 to 18 ms at the lowest.)

`--phases` runs some attacks only (`--phases "large results,log flood"`).

    .venv/bin/python bench/noisy_neighbour.py           # about 2 minutes on 2 CPUs
    .venv/bin/python bench/noisy_neighbour.py --quick   # shorter phases, smaller attacks
    .venv/bin/python bench/noisy_neighbour.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from procs import (
    ServerProcess,
    children_map,
    cmdline,
    isolated_env,
    progress,
    server_url,
    stopped_at_exit,
)

from ember.calling.tlsclient import client_context

REACH_P99_RATIO = 3.0
REACH_P99_S = 0.100
REACH_MEMORY_MIB = 512
MIB = 1024 * 1024
LARGE_BYTES = 60_000_000
CALLERS = 8  # large-result callers, and spawning callers
SAMPLE_S = 0.05
DRAIN_TIMEOUT_S = 300.0  # for the accepted spawned calls, once the spawning is over
# A call that gets no byte for this long is counted as its timeout, so that a platform
# that stalls gets a row in the table rather than a bench that never ends.
CALL_TIMEOUT_S = 120.0
PHASES = ("baseline", "large results", "log flood", "queue flood", "connection burst")

VICTIM_APP = """\
import ember


@ember.endpoint(snapshot=False, min_replicas=1, scaledown_window=600)
def noop() -> int:
    return 0
"""
NOISY_APP = """\
import sys
import time

import ember


@ember.endpoint(snapshot=False, concurrency=8, max_replicas=1, scaledown_window=600, timeout=600)
def large() -> str:
    return "x" * 60_000_000


@ember.endpoint(snapshot=False, max_replicas=1, scaledown_window=600, timeout=600)
def flood(seconds: float) -> int:
    line = "x" * 1023 + "\\n"
    printed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(100):
            sys.stdout.write(line)
        printed += 100
    sys.stdout.flush()
    return printed


@ember.endpoint(snapshot=False, concurrency=8, max_replicas=2, scaledown_window=600, timeout=600)
def slow() -> int:
    time.sleep(0.05)
    return 0


@ember.endpoint(snapshot=False, concurrency=64, max_replicas=1, scaledown_window=600)
async def noop() -> int:
    return 0
"""

# The victim's caller, in a process of its own: argv is URL, token, CA file, path, calls a
# second, seconds at least. Warms up, prints "ready", calls on its schedule until the
# seconds are over and its stdin is closed, then prints its latencies and errors as JSON.
VICTIM = """\
import json, sys, threading, time
import httpx
from ember.calling.tlsclient import client_context

url, token, ca, path = sys.argv[1:5]
rate, least = float(sys.argv[5]), float(sys.argv[6])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
client = httpx.Client(
    base_url=url, verify=client_context(ca), timeout=60,
    headers={"Authorization": "Bearer " + token},
)
for _ in range(10):
    client.post(path, json={}).raise_for_status()
print("ready", flush=True)
latencies, errors = [], []
began, n = time.perf_counter(), 0
while n / rate < least or not stop.is_set():
    due = began + n / rate
    wait = due - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    try:
        answer = client.post(path, json={})
        if answer.status_code != 200 or answer.json() != 0:
            errors.append(f"HTTP {answer.status_code} {answer.text[:200]}")
    except httpx.HTTPError as error:
        errors.append(f"{type(error).__name__}: {error}")
    latencies.append(time.perf_counter() - due)
    n += 1
print(json.dumps({"latencies": latencies, "errors": errors}), flush=True)
"""


class Platform:
    """The server, its URL and CA, and the processes whose memory is watched."""

    def __init__(self, server: ServerProcess, url: str, state: Path, env: dict[str, str]):
        self.server = server
        self.url = url
        self.ca = str(state / "ca.pem")
        self.admin = (state / "admin-token").read_text().strip()
        self.env = env
        self.tokens: dict[str, str] = {}

    def ember(self, *args: str, token: str | None = None) -> str:
        env = dict(self.env)
        if token is not None:
            env.update(EMBER_TOKEN=token, EMBER_SERVER_URL=self.url, EMBER_CA_CERT=self.ca)
        command = [sys.executable, "-m", "ember.cli.main", *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"ember {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def client(self, workspace: str | None = None, **options: Any) -> httpx.Client:
        token = self.admin if workspace is None else self.tokens[workspace]
        return httpx.Client(
            base_url=self.url,
            verify=client_context(self.ca),
            headers={"Authorization": f"Bearer {token}"},
            timeout=CALL_TIMEOUT_S,
            **options,
        )

    def async_client(self, workspace: str, **options: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url,
            verify=client_context(self.ca),
            headers={"Authorization": f"Bearer {self.tokens[workspace]}"},
            timeout=CALL_TIMEOUT_S,
            **options,
        )

    def watched(self) -> list[int]:
        """The control plane's process and its local worker's."""
        pid = self.server.process.pid
        workers = [
            child for child in children_map().get(pid, []) if "ember_worker" in cmdline(child)
        ]
        return [pid, *workers]


def rss(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """The highest sum of the processes' RSS, sampled every 50 ms in a thread."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, sum(rss(pid) for pid in self.pids))
            if self._stop.wait(SAMPLE_S):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def start(work: Path, started: list[ServerProcess], quiet: bool) -> Platform:
    """`ember server`, both workspaces with a deploy token each, each app deployed with
    its workspace's token, and every endpoint warmed once."""
    env = isolated_env(work)
    state = work / "state"
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    server = ServerProcess.start(
        "ember server", [*command, "--port", "0"], work / "server.log", env
    )
    started.append(server)
    platform = Platform(server, server_url(server, 120), state, env)
    for workspace, app, source in (("victim", "v", VICTIM_APP), ("noisy", "n", NOISY_APP)):
        platform.ember("workspace", "create", workspace)
        made = platform.ember("token", "create", "--workspace", workspace, "--scope", "deploy")
        platform.tokens[workspace] = made.strip()
        file = work / workspace / "app.py"
        file.parent.mkdir()
        file.write_text(source)
        progress(quiet, f"deploying {workspace}'s app ...")
        platform.ember("deploy", str(file), "--name", app, "--wait", token=made.strip())
    with platform.client("noisy") as client:
        for endpoint, body in (
            ("large", {}),
            ("flood", {"seconds": 0}),
            ("slow", {}),
            ("noop", {}),
        ):
            answer = client.post(f"/noisy--n--{endpoint}/", json=body)
            if answer.status_code != 200:
                raise RuntimeError(f"warming noisy {endpoint}: HTTP {answer.status_code}")
    server.remember()
    return platform


def status_counts(statuses: collections.Counter[str]) -> str:
    """'990 ok, 10 x 429' from a Counter of 'ok' and other outcomes."""
    parts = [f"{statuses['ok']} ok"] if statuses["ok"] else []
    parts += [f"{n} x {what}" for what, n in statuses.most_common() if what != "ok" and n]
    return ", ".join(parts) or "nothing"


def outcome(answer: httpx.Response) -> str:
    return "ok" if answer.status_code == 200 else str(answer.status_code)


# --- the attacks: each returns what the noisy workspace saw ---------------------------------


def large_results(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    def caller() -> collections.Counter[str]:
        seen: collections.Counter[str] = collections.Counter()
        with platform.client("noisy") as client:
            for sent in range(args.large_calls):
                try:
                    answer = client.post("/noisy--n--large/", json={})
                    short = answer.status_code == 200 and len(answer.content) < LARGE_BYTES
                    seen["short" if short else outcome(answer)] += 1
                except httpx.HTTPError as error:
                    seen[type(error).__name__] += 1
                    seen["not sent"] += args.large_calls - sent - 1  # they would stall too
                    break
        return seen

    with concurrent.futures.ThreadPoolExecutor(CALLERS) as pool:
        counts = sum(
            (f.result() for f in [pool.submit(caller) for _ in range(CALLERS)]),
            start=collections.Counter(),
        )
    return {"calls": dict(counts), "saw": status_counts(counts)}


def log_flood(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    with platform.client("noisy") as client:
        answer = client.post("/noisy--n--flood/", json={"seconds": args.seconds})
    if answer.status_code != 200:
        return {"printed": None, "dropped": None, "saw": f"HTTP {answer.status_code}"}
    printed = int(answer.json())
    dropped = dropped_lines(platform)
    if dropped is None:
        return {"printed": printed, "dropped": None, "saw": f"{printed:,} lines printed"}
    return {
        "printed": printed,
        "dropped": dropped,
        "saw": f"{printed:,} lines printed, {dropped:,} dropped",
    }


DROPPED = re.compile(
    r'ember:log_lines_dropped_total\{workspace="noisy",app="n",endpoint="flood"\} (\S+)'
)


def dropped_lines(platform: Platform) -> int | None:
    """/metrics' count of the flood's dropped lines, once it stops growing (the last
    marker comes within a second or so of the output's end); None where it has none."""
    last: int | None = None
    with platform.client() as admin:
        for _ in range(10):
            found = DROPPED.search(admin.get("/metrics").text)
            count = int(float(found[1])) if found else None
            if count is not None and count == last:
                break
            last = count
            time.sleep(0.5)
    return last


def queue_flood(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_queue_flood(platform, args))


async def _queue_flood(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    spawned: collections.Counter[str] = collections.Counter()
    accepted: list[str] = []
    examples: dict[str, str] = {}  # an answer of each status but 202

    async def caller() -> None:
        async with platform.async_client("noisy") as client:
            for _ in range(args.spawns):
                try:
                    answer = await client.post(
                        "/noisy--n--slow/", json={}, headers={"Prefer": "respond-async"}
                    )
                except httpx.HTTPError as error:
                    spawned[type(error).__name__] += 1
                    continue
                if answer.status_code == 202:
                    accepted.append(answer.json()["call_id"])
                else:
                    examples.setdefault(str(answer.status_code), answer.text[:300])
                spawned["accepted" if answer.status_code == 202 else str(answer.status_code)] += 1

    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    finished: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    lanes = asyncio.Semaphore(32)

    async def collect(client: httpx.AsyncClient, call_id: str) -> None:
        async with lanes:
            while True:
                try:
                    answer = await client.get(f"/v1/calls/{call_id}", params={"wait": 30})
                except httpx.HTTPError as error:
                    finished[type(error).__name__] += 1
                    return
                if answer.status_code != 202:
                    finished[outcome(answer)] += 1
                    return
                if time.monotonic() > deadline:
                    finished["unfinished"] += 1
                    return

    async with platform.async_client("noisy", limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.gather(*(collect(client, call_id) for call_id in accepted))
    lost = len(accepted) - finished["ok"]  # not answered 200 in the end, for whatever cause
    failed = collections.Counter({k: v for k, v in finished.items() if k != "ok"})
    turned_away = status_counts(
        collections.Counter({k: v for k, v in spawned.items() if k != "accepted"})
    )
    saw = f"{len(accepted)} accepted"
    if turned_away != "nothing":
        saw += f", {turned_away}"
    return {
        "spawned": dict(spawned),
        "accepted": len(accepted),
        "finished": dict(finished),
        "lost": lost,
        "examples": examples,
        "saw": f"{saw}, {lost} lost" + (f" ({status_counts(failed)})" if lost else ""),
    }


def connection_burst(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_connection_burst(platform, args))


async def _connection_burst(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    n = args.connections
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with platform.async_client("noisy", limits=limits) as client:

        async def one() -> None:
            try:
                answer = await client.post("/noisy--n--noop/", json={})
            except httpx.HTTPError as error:
                counts[type(error).__name__] += 1
                examples.setdefault(type(error).__name__, str(error)[:300])
                return
            counts[outcome(answer)] += 1
            if answer.status_code != 200:
                examples.setdefault(str(answer.status_code), answer.text[:300])

        examples: dict[str, str] = {}
        await asyncio.gather(*(one() for _ in range(n)))
    saw = f"{n}: {status_counts(counts)}"
    return {"calls": dict(counts), "examples": examples, "saw": saw}


def nothing(platform: Platform, args: argparse.Namespace) -> dict[str, Any]:
    return {"saw": "-"}


ATTACKS: dict[str, Callable[[Platform, argparse.Namespace], dict[str, Any]]] = {
    "baseline": nothing,
    "large results": large_results,
    "log flood": log_flood,
    "queue flood": queue_flood,
    "connection burst": connection_burst,
}


# --- a phase -----------------------------------------------------------------------------


@contextlib.contextmanager
def victim_calling(platform: Platform, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The victim's caller, warmed up and calling while the block runs; the dict it
    yields gets its latencies and errors once the block is over (and the phase's
    seconds are)."""
    command = [
        sys.executable,
        "-c",
        VICTIM,
        platform.url,
        platform.tokens["victim"],
        platform.ca,
        "/victim--v--noop/",
        str(args.rate),
        str(args.seconds),
    ]
    caller = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert caller.stdin is not None and caller.stdout is not None
    result: dict[str, Any] = {}
    try:
        if caller.stdout.readline().strip() != "ready":
            _, err = caller.communicate(timeout=30)
            raise RuntimeError(f"the victim's caller did not start: {err.strip()[-2000:]}")
        result["until"] = time.monotonic() + args.seconds
        yield result
        # communicate() closes its stdin first: the phase is over.
        out, err = caller.communicate(timeout=args.seconds + 120)
        if caller.returncode != 0:
            raise RuntimeError(f"the victim's caller failed: {err.strip()[-2000:]}")
        result.update(json.loads(out))
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()


class AttackerCpus:
    """This process (the noisy workspace's clients) held to a CPU quota while an attack
    runs, in a cgroup of its own beside the one it came from (the worker's cgroup helpers
    make it, cgroup v1 or v2); `problem` says why not where it cannot be."""

    def __init__(self, cpus: float) -> None:
        self.group: Any = None
        self.problem: str | None = None
        if cpus <= 0:
            self.problem = "not asked (--attacker-cpus 0)"
            return
        from ember_worker.processes.cgroups import CPU, find_tree

        tree = find_tree()
        self.problem = tree.problem(CPU)
        if self.problem is not None:
            return
        base = tree.bases[CPU]
        try:  # the lowest weight: the clients take only what the platform leaves
            weight = "cpu.shares" if tree.version == 1 else "cpu.weight"
            (base / weight).write_text("2" if tree.version == 1 else "1")
            self.group = tree.create("attackers", cpu_limit=cpus)
        except OSError as error:
            self.problem = f"cannot make its cgroup: {error}"
            return
        self.home = base.parent / "cgroup.procs"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self.group is None:
            yield
            return
        for procs in self.group.procs_files:
            procs.write_text(str(os.getpid()))
        try:
            yield
        finally:
            self.home.write_text(str(os.getpid()))

    def remove(self) -> None:
        if self.group is not None:
            self.group.remove()
            self.group.cpu_path.parent.rmdir()


def phase(
    platform: Platform, name: str, args: argparse.Namespace, attackers: AttackerCpus
) -> dict[str, Any]:
    row: dict[str, Any] = {"phase": name}
    began = time.monotonic()
    try:
        with victim_calling(platform, args) as victim, PeakMemory(platform.watched()) as memory:
            try:
                with attackers.held():  # the victim's caller started outside it
                    row["noisy"] = ATTACKS[name](platform, args)
                time.sleep(max(0.0, victim["until"] - time.monotonic()))
            finally:
                row["peak_memory_bytes"] = memory.peak
    except Exception as error:  # the table shows what the phase got to
        row["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
        return row
    finally:
        row["seconds"] = time.monotonic() - began
        platform.server.remember()
    latencies = sorted(victim["latencies"])
    row["victim"] = {
        "calls": len(latencies),
        "p50_s": statistics.median(latencies),
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "max_s": latencies[-1],
        "errors": len(victim["errors"]),
        "first_errors": victim["errors"][:5],
    }
    return row


def measure(args: argparse.Namespace, confinement: dict[str, Any]) -> list[dict[str, Any]]:
    """The phases' rows; `confinement` gets the attackers' CPU quota, or why none."""
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="ember-bench-noisy-") as folder,
        stopped_at_exit() as started,
    ):
        progress(args.quiet, "starting ember server ...")
        try:
            platform = start(Path(folder), started, args.quiet)
        except Exception as error:
            traceback.print_exc()
            rows.append({"phase": "set-up", "error": f"{type(error).__name__}: {error}"})
            return rows
        attackers = AttackerCpus(args.attacker_cpus)
        if attackers.problem is not None:
            progress(args.quiet, f"the attackers' clients are not confined: {attackers.problem}")
        confinement["cpus"] = args.attacker_cpus
        confinement["not_confined"] = attackers.problem
        try:
            run_phases(platform, args, attackers, rows)
        finally:
            attackers.remove()
        if platform.server.process.poll() is not None:
            print(f"the server exited:\n{platform.server.tail()}", file=sys.stderr)
    return rows


def run_phases(
    platform: Platform,
    args: argparse.Namespace,
    attackers: AttackerCpus,
    rows: list[dict[str, Any]],
) -> None:
    for name in args.phases:
        if platform.server.process.poll() is not None:
            rows.append({"phase": name, "error": "the server exited"})
            continue
        progress(args.quiet, f"phase: {name} ...")
        row = phase(platform, name, args, attackers)
        rows.append(row)
        victim = row.get("victim")
        if victim:
            progress(
                args.quiet,
                f"{name}: p50 {victim['p50_s'] * 1e3:.1f} ms, p99 {victim['p99_s'] * 1e3:.1f}"
                f" ms, {victim['errors']} errors; noisy: {row['noisy']['saw']}",
            )


# --- the report --------------------------------------------------------------------------


def judge(rows: list[dict[str, Any]], phases: Sequence[str]) -> dict[str, Any]:
    """Each phase's ratios and misses, and a verdict per reach (None: not measured);
    complete when every phase of `phases` was measured."""
    base = next((r for r in rows if r["phase"] == "baseline" and "victim" in r), None)
    reach: dict[str, bool | None] = {"latency": None, "errors": None, "memory": None, "lost": None}
    for row in rows:
        misses = row.setdefault("misses", [])
        if "error" in row:
            misses.append("error")
        victim = row.get("victim")
        if victim is None:
            continue
        if victim["errors"]:
            misses.append("victim errors")
        reach["errors"] = reach["errors"] is not False and not victim["errors"]
        if base is None or row is base:
            continue
        row["p99_ratio"] = victim["p99_s"] / base["victim"]["p99_s"]
        slow = row["p99_ratio"] > REACH_P99_RATIO or victim["p99_s"] > REACH_P99_S
        if slow:
            misses.append("p99")
        reach["latency"] = reach["latency"] is not False and not slow
        if "peak_memory_bytes" in row:
            row["added_memory_bytes"] = row["peak_memory_bytes"] - base["peak_memory_bytes"]
            big = row["added_memory_bytes"] > REACH_MEMORY_MIB * MIB
            if big:
                misses.append("memory")
            reach["memory"] = reach["memory"] is not False and not big
        lost = row.get("noisy", {}).get("lost")
        if lost is not None:
            if lost:
                misses.append("lost calls")
            reach["lost"] = not lost
    complete = all("error" not in r for r in rows) and len(rows) == len(phases)
    overall = complete and all(reach.values())
    return {"reach": reach, "complete": complete, "overall": overall}


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else "PASS" if ok else "MISS"


def table(rows: list[dict[str, Any]], judged: dict[str, Any]) -> str:
    saw = [str(row.get("noisy", {}).get("saw", "")) for row in rows]
    width = max(len("noisy workspace saw"), *map(len, saw)) + 2
    head = (
        f"{'phase':18}{'p50 ms':>8}{'p99 ms':>9}{'p99/base':>9}{'errors':>7}"
        f"{'peak MiB':>10}{'+MiB':>7}  {'noisy workspace saw':{width}}verdict"
    )
    lines = ["the victim's no-op calls while the noisy workspace ...", "", head]
    for row, noisy in zip(rows, saw, strict=True):
        victim = row.get("victim")
        if victim is None:  # the phase failed: what it got to
            peak = row.get("peak_memory_bytes")
            memory = f"{peak / MIB:>10.0f}" if peak else f"{'-':>10}"
            lines.append(
                f"{row['phase']:18}{'-':>8}{'-':>9}{'-':>9}{'-':>7}{memory}{'-':>7}  "
                f"{noisy:{width}}error: {row.get('error', '')}"
            )
            continue
        ratio = f"{row['p99_ratio']:.2f}x" if "p99_ratio" in row else "-"
        added = row.get("added_memory_bytes")
        added_text = f"{added / MIB:+.0f}" if added is not None else "-"
        is_base = row["phase"] == "baseline"
        state = "-" if is_base and not row["misses"] else "PASS"
        if row["misses"]:
            state = "MISS: " + ", ".join(row["misses"])
        lines.append(
            f"{row['phase']:18}{victim['p50_s'] * 1e3:>8.1f}{victim['p99_s'] * 1e3:>9.1f}"
            f"{ratio:>9}{victim['errors']:>7}{row['peak_memory_bytes'] / MIB:>10.0f}"
            f"{added_text:>7}  {noisy:{width}}{state}"
        )
        for error in victim["first_errors"][:2]:
            lines.append(f"{'':18}victim error: {error[:150]}")
    reach = judged["reach"]
    lines += [
        "",
        f"victim p99 under every attack <= {REACH_P99_RATIO:g}x alone and <= "
        f"{REACH_P99_S * 1e3:.0f} ms: {verdict(reach['latency'])}",
        f"no error for the victim: {verdict(reach['errors'])}",
        f"peak memory <= baseline + {REACH_MEMORY_MIB} MiB: {verdict(reach['memory'])}",
        f"no accepted spawned call lost: {verdict(reach['lost'])}",
        f"overall: {'PASS' if judged['overall'] else 'MISS'}"
        + ("" if judged["complete"] else " (not every phase ran to its end)"),
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=None, help="a phase (10; quick 4)")
    parser.add_argument("--rate", type=float, default=20.0, help="victim calls a second (20)")
    parser.add_argument("--large-calls", type=int, default=None, help="per caller (3; quick 1)")
    parser.add_argument("--spawns", type=int, default=None, help="per caller (300; quick 100)")
    parser.add_argument(
        "--connections", type=int, default=None, help="in the burst (1000; quick 300)"
    )
    parser.add_argument(
        "--attacker-cpus",
        type=float,
        default=1.0,
        help="CPUs the noisy workspace's clients (this process) may use during an attack "
        "(1; 0: unconfined)",
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES[1:]),
        help="the attacks to run, comma-separated (all); the baseline always runs first",
    )
    parser.add_argument("--quick", action="store_true", help="4 s phases, smaller attacks")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    chosen = {name.strip() for name in args.phases.split(",") if name.strip()}
    unknown = chosen - set(PHASES)
    if unknown:
        parser.error(f"no such phase: {', '.join(sorted(unknown))} (phases: {', '.join(PHASES)})")
    args.phases = [name for name in PHASES if name == "baseline" or name in chosen]
    defaults = {"seconds": (10.0, 4.0), "large_calls": (3, 1), "spawns": (300, 100)}
    defaults["connections"] = (1000, 300)
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    confinement: dict[str, Any] = {}
    rows = measure(args, confinement)
    judged = judge(rows, args.phases)
    if args.json:
        print(json.dumps({"phases": rows, "attackers": confinement, **judged}, indent=2))
    else:
        print(table(rows, judged))
        why_not = confinement.get("not_confined")
        print(
            f"the noisy workspace's clients: held to {args.attacker_cpus:g} CPU during attacks"
            if confinement and why_not is None
            else f"the noisy workspace's clients: not confined ({why_not})"
        )
    if not judged["complete"]:
        return 2
    return 0 if judged["overall"] else 1


if __name__ == "__main__":
    sys.exit(main())
