"""Failover of a platform of three control-plane processes (issue 39, items 2-3).

Three `ember server --no-worker --database ... --blob-store s3://...` processes on one
throwaway PostgreSQL (tests/postgres_cluster.py) and one S3 API (moto, in this process),
two workers given all three URLs, and two endpoints. Measured in one run:

- **Recovery**: `kill -9` of the process that owns the platform, under load (synchronous
  calls and spawned calls with idempotency keys); the time from the kill to the first
  answer of each endpoint, asked through another process. Several kills, the killed
  process started again (as a standby) before the next. Reach: at most 5 s at P99.
- **Calls lost**: every spawned call's result is collected at the end; one that fails or
  answers wrong is lost. Reach: 0.
- **Forwarding**: a no-op call at concurrency 1 through the owner and through a standby
  (which pipes the connection to the owner), rounds alternating; the baseline is the
  owner. Reach: at most 1 ms more at P50 through the standby.

    .venv/bin/python bench/failover.py            # about two minutes
    .venv/bin/python bench/failover.py --kills 5 --json
    .venv/bin/python bench/failover.py --quick    # one kill, one forwarding round

A run that fails part-way prints what the parts before measured, and which part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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

import httpx  # noqa: E402
from harness import Platform, free_port, wait_for  # type: ignore[import-not-found]  # noqa: E402
from postgres_cluster import start_cluster  # type: ignore[import-not-found]  # noqa: E402

import ember  # noqa: E402
from ember.config import ClientConfig  # noqa: E402
from ember.errors import ConnectionCutError, RemoteError  # noqa: E402

REACH_RECOVERY_P99_S = 5.0
REACH_LOST = 0
REACH_ADDED_P50_MS = 1.0
APP = "failbench"
BUCKET = "ember-failover-bench"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SHARED_FILES = (
    "ca.pem",
    "ca-key.pem",
    "server.pem",
    "server-key.pem",
    "admin-token",
    "webhook-secret",
)
ENDPOINTS = ("noop", "work")

APP_SOURCE = """\
import time

import ember


@ember.endpoint(min_replicas=1, concurrency=64)
async def noop() -> dict:
    return {}


@ember.endpoint(retries=3, concurrency=4)
def work(x: int, seconds: float = 0.05) -> dict:
    time.sleep(seconds)
    return {"x": x}
"""


class Peers:
    """Three processes of one platform on fixed ports; two workers given all three."""

    def __init__(self, root: Path, database: str, s3: str) -> None:
        self.root = root
        self.database = database
        self.extra = (
            "--no-worker", "--database", database, "--blob-store", f"s3://{BUCKET}/ember",
            "--blob-s3-endpoint-url", s3,
        )  # fmt: skip
        self.urls = [f"https://127.0.0.1:{free_port()}" for _ in range(3)]
        self.processes: list[Platform | None] = [None, None, None]
        self.workers: list[subprocess.Popen[bytes]] = []

    def start(self, index: int) -> None:
        old = self.processes[index]
        if old is not None:
            old.stop()
        state = self.root / f"cp{index}" / "state"
        if index and not state.exists():
            state.mkdir(parents=True, mode=0o700)
            for name in SHARED_FILES:
                shutil.copy2(self.root / "cp0" / "state" / name, state / name)
        port = int(self.urls[index].rsplit(":", 1)[1])
        platform = Platform(self.root / f"cp{index}", port=port, extra=self.extra, env=AWS_ENV)
        self.processes[index] = platform.start()

    @property
    def first(self) -> Platform:
        assert self.processes[0] is not None
        return self.processes[0]

    def config(self, *indexes: int) -> ClientConfig:
        token = (self.root / "cp0" / "state" / "admin-token").read_text().strip()
        urls = tuple(self.urls[i] for i in indexes)
        return ClientConfig(
            urls[0], token, self.first.ca, server_urls=urls if len(urls) > 1 else ()
        )

    def owner(self) -> int:
        import psycopg

        with psycopg.connect(self.database, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder_url FROM leases WHERE name = 'platform' "
                "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
            ).fetchone()
        if row is None:
            raise RuntimeError("nobody owns the platform")
        return self.urls.index(row[0])

    def join(self, name: str) -> None:
        token = self.first.ember("token", "create", "--scope", "worker").stdout.strip()
        command = [
            sys.executable, "-m", "ember.cli.main", "worker", "--server", ",".join(self.urls),
            "--token", token, "--ca-cert", self.first.ca, "--work-dir", str(self.root / name),
            "--name", name,
        ]  # fmt: skip
        with (self.root / f"{name}.log").open("w") as log:
            self.workers.append(
                subprocess.Popen(command, env=self.first.env, stdout=subprocess.DEVNULL, stderr=log)
            )

    def stop(self) -> None:
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        for process in self.processes:
            if process is not None:
                process.stop()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def forwarding(peers: Peers, rounds: int, requests: int) -> dict[str, Any]:
    """A no-op call at concurrency 1 through the owner and through a standby, alternating."""
    owner = peers.owner()
    standby = (owner + 1) % 3
    token = (peers.root / "cp0" / "state" / "admin-token").read_text().strip()
    samples: dict[str, list[float]] = {"owner": [], "standby": []}
    by_round: list[float] = []
    for _ in range(rounds):
        p50s = {}
        for name, index in (("owner", owner), ("standby", standby)):
            with httpx.Client(
                base_url=peers.urls[index],
                verify=peers.first.ca,
                headers={"Authorization": f"Bearer {token}"},
            ) as client:
                for _ in range(20):  # warm: the connection, the TLS session
                    client.post(f"/{APP}--noop/", json={})
                taken = []
                for _ in range(requests):
                    started = time.perf_counter()
                    response = client.post(f"/{APP}--noop/", json={})
                    taken.append((time.perf_counter() - started) * 1000)
                    if response.status_code != 200:
                        raise RuntimeError(f"noop answered {response.status_code}: {response.text}")
            samples[name] += taken
            p50s[name] = statistics.median(taken)
        by_round.append(p50s["standby"] - p50s["owner"])
    result = {
        name: {"p50_ms": statistics.median(v), "p99_ms": percentile(v, 0.99), "samples": len(v)}
        for name, v in samples.items()
    }
    added = result["standby"]["p50_ms"] - result["owner"]["p50_ms"]
    return {**result, "added_p50_ms": added, "added_p50_ms_by_round": by_round}


class Load:
    """Synchronous calls in two threads and spawned calls in one, until stopped."""

    def __init__(self, config: ClientConfig, prefix: str) -> None:
        self.work = ember.Endpoint.lookup(APP, "work", config=config)
        self.prefix = prefix
        self.spawned: list[tuple[int, Any]] = []
        self.sync_ok = 0
        self.sync_retryable = 0  # cut connections, handed-over calls
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._calls) for _ in range(2)]
        self._threads.append(threading.Thread(target=self._spawns))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _calls(self) -> None:
        while not self._stop.is_set():
            try:
                self.work.call(x=1)
                self.sync_ok += 1
            except ConnectionCutError:
                self.sync_retryable += 1
            except RemoteError as error:
                if error.error_type == "control_plane_stopping":
                    self.sync_retryable += 1
                else:
                    self.errors.append(str(error))
            except Exception as error:
                self.errors.append(f"{type(error).__name__}: {error}")

    def _spawns(self) -> None:
        number = 0
        while not self._stop.is_set():
            number += 1
            try:
                handle = self.work.spawn(x=number, _idempotency_key=f"{self.prefix}-{number}")
                self.spawned.append((number, handle))
            except Exception as error:
                self.errors.append(f"spawn: {type(error).__name__}: {error}")
            self._stop.wait(0.05)


def first_answer(peers: Peers, index: int, endpoint: str, killed_at: float) -> float:
    """Seconds from the kill until `endpoint` answers through process `index`."""
    call = ember.Endpoint.lookup(APP, endpoint, config=peers.config(index))
    arguments: dict[str, Any] = {"x": 0, "seconds": 0.0} if endpoint == "work" else {}
    while True:
        try:
            call.call(**arguments)
            return time.monotonic() - killed_at
        except (ConnectionCutError, RemoteError):
            time.sleep(0.02)


def first_answers(peers: Peers, index: int, killed_at: float) -> dict[str, float]:
    """Every endpoint's first answer after the kill, asked at once through `index`."""
    answers: dict[str, float] = {}

    def ask(endpoint: str) -> None:
        answers[endpoint] = first_answer(peers, index, endpoint, killed_at)

    threads = [threading.Thread(target=ask, args=(e,)) for e in ENDPOINTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return answers


def kills(peers: Peers, count: int) -> dict[str, Any]:
    config = peers.config(0, 1, 2)
    recovery: dict[str, list[float]] = {name: [] for name in ENDPOINTS}
    load = Load(config, f"bench-{os.getpid()}")
    load.start()
    try:
        for number in range(count):
            wanted = 10 * (number + 1)
            wait_for(lambda: load.sync_ok >= wanted, 60)  # noqa: B023 - waited for here
            owner = peers.owner()
            victim = peers.processes[owner]
            assert victim is not None and victim.process is not None
            os.killpg(victim.process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            answers = first_answers(peers, (owner + 1) % 3, killed_at)
            for name in ENDPOINTS:
                recovery[name].append(answers.get(name, float("inf")))
            progress(
                f"kill {number + 1}: "
                + ", ".join(f"{e} {answers.get(e, float('inf')):.2f} s" for e in ENDPOINTS)
            )
            peers.start(owner)  # back, as a standby
    finally:
        load.stop()
    lost = 0
    for number, handle in load.spawned:
        try:
            if handle.get(timeout=120) != {"x": number}:
                lost += 1
        except Exception:
            lost += 1
    every = [t for values in recovery.values() for t in values]
    return {
        "kills": count,
        "recovery_s": recovery,
        "recovery_p50_s": statistics.median(every),
        "recovery_p99_s": percentile(every, 0.99),
        "recovery_max_s": max(every),
        "spawned": len(load.spawned),
        "lost": lost,
        "sync_ok": load.sync_ok,
        "sync_retryable": load.sync_retryable,
        "sync_errors": load.errors[:5],
        "sync_error_count": len(load.errors),
    }


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def report(result: dict[str, Any]) -> str:
    """The figures and verdicts of the parts that ran, and the failure if one did."""
    lines = [
        "failover: 3 control-plane processes, PostgreSQL, S3 (moto), 2 workers",
        f"  machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "",
    ]
    verdict = result["verdicts"]
    ends = []
    if "forwarding" in result:
        fwd = result["forwarding"]
        by_round = ", ".join(f"{x:+.3f}" for x in fwd["added_p50_ms_by_round"])
        lines += [
            f"{'forwarding, no-op call, c=1':34}{'owner':>10}{'standby':>10}{'standby-owner':>15}",
            f"{'  p50 (ms)':34}{fwd['owner']['p50_ms']:>10.3f}{fwd['standby']['p50_ms']:>10.3f}"
            f"{fwd['added_p50_ms']:>+15.3f}",
            f"{'  p99 (ms)':34}{fwd['owner']['p99_ms']:>10.3f}{fwd['standby']['p99_ms']:>10.3f}"
            f"{fwd['standby']['p99_ms'] - fwd['owner']['p99_ms']:>+15.3f}",
            f"  samples: {fwd['owner']['samples']} each; added p50 by round: {by_round}",
            "",
        ]
    if "kills" in result:
        kill = result["kills"]
        lines.append(
            f"kill -9 of the owner under load, {kill['kills']} kills: first answer after the "
            "kill (s)"
        )
        for name, values in kill["recovery_s"].items():
            lines.append(f"  {name:10}" + "  ".join(f"{v:6.2f}" for v in values))
        lines += [
            f"  all endpoints: p50 {kill['recovery_p50_s']:.2f}  p99 {kill['recovery_p99_s']:.2f}"
            f"  max {kill['recovery_max_s']:.2f}",
            f"  spawned calls: {kill['spawned']}, lost {kill['lost']}; synchronous calls: "
            f"{kill['sync_ok']} answered, {kill['sync_retryable']} retryable errors, "
            f"{kill['sync_error_count']} other errors {kill['sync_errors'] or ''}",
            "",
        ]
        ends += [
            f"recovery p99 {kill['recovery_p99_s']:.2f} s (reach <= {REACH_RECOVERY_P99_S:g} s):"
            " " + ("PASS" if verdict["recovery"] else "MISS"),
            f"calls lost {kill['lost']} (reach {REACH_LOST}): "
            + ("PASS" if verdict["lost"] else "MISS"),
        ]
    if "forwarding" in result:
        ends.append(
            f"added p50 through a standby {result['forwarding']['added_p50_ms']:+.3f} ms (reach "
            f"<= {REACH_ADDED_P50_MS:g} ms): " + ("PASS" if verdict["forwarding"] else "MISS")
        )
    if "failed" in result:
        failed = result["failed"]
        ends.append(f"FAILED in {failed['part']}: {failed['error']}")
    return "\n".join(lines + ends)


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    """The verdicts of the parts that ran."""
    found = {}
    if "kills" in result:
        found["recovery"] = result["kills"]["recovery_p99_s"] <= REACH_RECOVERY_P99_S
        found["lost"] = result["kills"]["lost"] <= REACH_LOST
    if "forwarding" in result:
        found["forwarding"] = result["forwarding"]["added_p50_ms"] <= REACH_ADDED_P50_MS
    return found


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills result["forwarding"], then result["kills"]; result["failed"] names the part
    a failure happens in."""
    import boto3
    from moto.server import ThreadedMotoServer

    result["failed"] = {"part": "starting the platform", "error": ""}  # until it is up
    root = Path(tempfile.mkdtemp(prefix="ember-failover-bench-"))
    cluster = start_cluster()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    s3 = f"http://{host}:{port}"
    boto3.client(
        "s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=BUCKET)  # fmt: skip
    peers = Peers(root, cluster.new_database(), s3)
    try:
        progress("starting three control-plane processes and two workers")
        for index in range(3):
            peers.start(index)
        peers.join("node-a")
        peers.join("node-b")
        wait_for(lambda: len(peers.first.status()["workers"]) == 2, 60)
        app = root / "app.py"
        app.write_text(APP_SOURCE)
        peers.first.deploy(app, APP)
        ember.Endpoint.lookup(APP, "noop", config=peers.config(0)).call()
        result["failed"]["part"] = "forwarding"
        progress("forwarding: owner against standby")
        result["forwarding"] = forwarding(peers, args.rounds, args.requests)
        result["failed"]["part"] = "kills"
        progress(f"{args.kills} kills under load")
        result["kills"] = kills(peers, args.kills)
        del result["failed"]
    finally:
        peers.stop()
        moto.stop()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error (with "
        "--quick: 0 once every verdict is printed).",
    )
    parser.add_argument("--kills", type=int, help="owners killed, one after another (3; quick 1)")
    parser.add_argument("--rounds", type=int, help="forwarding rounds per target (4; quick 1)")
    parser.add_argument("--requests", type=int, help="calls per forwarding round (300; quick 100)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one kill and one forwarding round: every verdict in seconds, too few samples "
        "to judge a reach",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    for name, (full, quick) in {"kills": (3, 1), "rounds": (4, 1), "requests": (300, 100)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; the platform's processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the parts before measured is printed all the same
        failed = result.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(error).__name__}: {error}"
    result["verdicts"] = verdicts(result)
    print(json.dumps(result, indent=2) if args.json else report(result))
    if "failed" in result:
        failed = result["failed"]
        print(f"failover bench: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    if args.quick:  # one kill, one round: the verdicts are printed, not judged
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
