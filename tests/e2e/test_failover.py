"""Three control-plane processes on one PostgreSQL and one S3 API (moto), two workers: one
platform. `kill -9` of the process that owns it, under load, loses no spawned call; the
synchronous calls it held fail with ConnectionCutError or succeed; the endpoint answers
again within 5 s through another process; autoscaling and schedules go on. A rolling
restart (each process stopped and started in turn) loses no spawned call either."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import Platform, free_port, wait_for

import ember
from ember.config import ClientConfig
from ember.errors import ConnectionCutError, RemoteError

APP = "failover"
BUCKET = "ember-failover"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# What every process of one platform shares: its CA and certificate, the admin token and
# the webhook secret (docs/operations.md, "Several machines").
SHARED_FILES = (
    "ca.pem",
    "ca-key.pem",
    "server.pem",
    "server-key.pem",
    "admin-token",
    "webhook-secret",
)
RECOVERY_S = 5.0


class Peers:
    """Three `ember server` processes of one platform, on fixed ports, and two workers
    given all three URLs."""

    def __init__(self, root: Path, database: str, s3_endpoint: str) -> None:
        self.root = root
        self.database = database
        extra = ("--no-worker", "--database", database, "--blob-store", f"s3://{BUCKET}/ember")
        self.extra = (*extra, "--blob-s3-endpoint-url", s3_endpoint)
        self.ports = [free_port() for _ in range(3)]
        self.urls = [f"https://127.0.0.1:{port}" for port in self.ports]
        self.processes: list[Platform | None] = [None, None, None]
        self.workers: list[subprocess.Popen[str]] = []

    def start(self, index: int) -> Platform:
        old = self.processes[index]
        if old is not None:
            old.stop()  # reaped (one killed), its output closed
            self._keep_output(index, old)
        root = self.root / f"cp{index}"
        if index > 0 and not (root / "state").exists():
            (root / "state").mkdir(parents=True, mode=0o700)
            for name in SHARED_FILES:
                shutil.copy2(self.root / "cp0" / "state" / name, root / "state" / name)
        process = Platform(root, port=self.ports[index], extra=self.extra, env=AWS_ENV).start()
        self.processes[index] = process
        return process

    @property
    def first(self) -> Platform:
        assert self.processes[0] is not None
        return self.processes[0]

    def config(self) -> ClientConfig:
        token = (self.root / "cp0" / "state" / "admin-token").read_text().strip()
        return ClientConfig(self.urls[0], token, self.first.ca, server_urls=tuple(self.urls))

    def owner(self) -> int:
        with psycopg.connect(self.database, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder_url FROM leases WHERE name = 'platform' "
                "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
            ).fetchone()
        assert row is not None, "nobody owns the platform"
        return self.urls.index(row[0])

    def join(self, name: str) -> None:
        token = self.first.ember("token", "create", "--scope", "worker").stdout.strip()
        work_dir = self.root / name
        command = [
            sys.executable, "-m", "ember.cli.main", "worker", "--server", ",".join(self.urls),
            "--token", token, "--ca-cert", self.first.ca, "--work-dir", str(work_dir),
            "--name", name, "--cpu", "2",
        ]  # fmt: skip
        with work_dir.with_suffix(".log").open("w") as log:
            self.workers.append(
                subprocess.Popen(
                    command, env=self.first.env, stdout=subprocess.DEVNULL, stderr=log, text=True
                )
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
        for index, process in enumerate(self.processes):
            if process is not None:
                process.stop()
                self._keep_output(index, process)

    def _keep_output(self, index: int, process: Platform) -> None:
        """A stopped process's output, kept beside the workers' logs for a failure's
        post-mortem (a restarted one's after its predecessor's)."""
        with (self.root / f"cp{index}.log").open("a") as log:
            log.write("\n".join(process.output) + "\n")


@pytest.fixture(scope="module")
def peers(
    tmp_path_factory: pytest.TempPathFactory, postgres_cluster: Any, s3_endpoint: str
) -> Iterator[Peers]:
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, **_aws()).create_bucket(Bucket=BUCKET)
    peers = Peers(tmp_path_factory.mktemp("failover"), postgres_cluster.new_database(), s3_endpoint)
    try:
        peers.start(0)  # the first takes the lease and makes the shared files
        peers.start(1)
        peers.start(2)
        peers.join("node-a")
        peers.join("node-b")
        wait_for(lambda: len(peers.first.status()["workers"]) == 2, 60)
        peers.first.deploy(Path(__file__).parent / "apps" / "failover.py", APP)
        yield peers
    finally:
        peers.stop()


def _aws() -> dict[str, str]:
    return {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


class Load:
    """Synchronous calls in a few threads and spawned calls (with idempotency keys) in
    another, until stopped; every outcome recorded."""

    def __init__(self, config: ClientConfig, prefix: str) -> None:
        self.work = ember.Endpoint.lookup(APP, "work", config=config)
        self.prefix = prefix
        self.spawned: list[tuple[int, ember.CallHandle]] = []
        self.answers: list[float] = []  # when each synchronous call answered
        self.cut: list[str] = []  # retryable errors: cut connections, handed-over calls
        self.errors: list[str] = []  # anything else
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._calls) for _ in range(3)]
        self._threads.append(threading.Thread(target=self._spawns))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _calls(self) -> None:
        while not self._stop.is_set():
            try:
                assert self.work.call(x=7, seconds=0.05) == {"x": 7}
                self.answers.append(time.monotonic())
            except ConnectionCutError as error:
                self.cut.append(str(error))
            except RemoteError as error:
                if error.error_type != "control_plane_stopping":  # from a process handing over
                    raise
                self.cut.append(str(error))
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
                self.errors.append(f"spawn {number}: {type(error).__name__}: {error}")
            self._stop.wait(0.1)

    def check_spawned(self) -> None:
        """Each spawned call ran (at least once) and its result is kept."""
        assert len(self.spawned) >= 10
        for number, handle in self.spawned:
            assert handle.get(timeout=120) == {"x": number}


def _replicas(process: Platform) -> list[dict[str, Any]]:
    with process.client() as client:
        rows: list[dict[str, Any]] = client.get("/v1/replicas", params={"app": APP}).json()[
            "replicas"
        ]
    return rows


def _adopted(process: Platform) -> set[str]:
    """The ids of the replicas on `process` that it adopted from a dead owner and that
    have served since."""
    return {
        r["id"]
        for r in _replicas(process)
        if r["state"] == "ready" and r["start_kind"] == "adopted" and r["served"] > 0
    }


def _last_tick(config: ClientConfig) -> float:
    ticks = ember.Dict("ticks", app=APP, config=config)
    return float(ticks.get("last", 0.0))


def test_kill_9_of_the_owner_under_load_loses_nothing(peers: Peers) -> None:
    config = peers.config()
    work = ember.Endpoint.lookup(APP, "work", config=config)
    assert work.call(x=1) == {"x": 1}
    wait_for(lambda: _last_tick(config) > 0, 30)  # the schedule runs
    owner = peers.owner()
    victim = peers.processes[owner]
    assert victim is not None and victim.process is not None
    serving = {r["id"] for r in _replicas(victim) if r["label"] == f"{APP}--work"}
    assert serving
    counting = ember.Endpoint.lookup(APP, "count", config=config).stream(n=600)
    assert next(counting) == 0  # a stream in flight when the owner dies
    with Load(config, "kill") as load:
        wait_for(lambda: len(load.answers) >= 10, 30)
        os.killpg(victim.process.pid, signal.SIGKILL)
        killed_at, killed_wall = time.monotonic(), time.time()
        # Through the next process in the list: it forwards to whichever takes over.
        probe_config = ClientConfig(peers.urls[(owner + 1) % 3], config.token, config.ca_cert)
        probe = ember.Endpoint.lookup(APP, "work", config=probe_config)
        assert probe.call(x=2, seconds=0.0) == {"x": 2}
        recovered = time.monotonic() - killed_at
        # Enough of each kind of call to check, however slowly a loaded machine spawns.
        wait_for(
            lambda: (
                len([t for t in load.answers if t > killed_at]) >= 10 and len(load.spawned) >= 10
            ),
            60,
        )
    print(f"answered again {recovered:.2f} s after the kill; {len(load.cut)} calls cut")
    # The replicas that served before the kill serve on under the new owner: adopted when
    # their worker said hello there and their channel opened again, not started anew.
    survivor = peers.processes[peers.owner()]
    assert survivor is not None
    try:
        wait_for(lambda: serving & _adopted(survivor), 30)
    except AssertionError:
        rows = [r for r in _replicas(survivor) if r["label"] == f"{APP}--work"]
        raise AssertionError(f"none of {sorted(serving)} adopted and serving: {rows}") from None
    adopted_after = time.monotonic() - killed_at
    adopted = sorted(serving & _adopted(survivor))
    print(f"replicas {adopted} adopted and serving {adopted_after:.2f} s after the kill")
    with pytest.raises(RemoteError, match="ended before it was whole") as cut:
        list(counting)  # cut, and said so
    assert cut.value.error_type == "stream_cut_short"
    assert not load.errors, load.errors
    assert recovered < RECOVERY_S
    assert peers.owner() != owner
    load.check_spawned()
    # The schedule ran under the new owner, and the endpoint has replicas again.
    wait_for(lambda: _last_tick(config) > killed_wall, 30)
    with peers.processes[peers.owner()].client() as client:  # type: ignore[union-attr]
        rows = client.get("/v1/apps").json()["endpoints"]
    assert next(r for r in rows if r["label"] == f"{APP}--work")["replicas"].get("ready", 0) >= 1
    # A new app's bundle reaches the workers from a live process (their channel moved on
    # along their --server list; the killed one is still down).
    source = Path(__file__).parent / "apps" / "failover.py"
    fresh = peers.root / "fresh" / "app.py"
    fresh.parent.mkdir()
    fresh.write_text(source.read_text() + "\n# another bundle\n")
    survivor.deploy(fresh, "fresh")
    fresh_work = ember.Endpoint.lookup("fresh", "work", config=config)
    assert fresh_work.call(x=3, seconds=0.0) == {"x": 3}
    peers.start(owner)  # back, as a standby


def test_a_rolling_restart_loses_no_spawned_call(peers: Peers) -> None:
    config = peers.config()
    with Load(config, "rolling") as load:
        for index in range(3):
            wait_for(lambda: len(load.answers) >= 5, 30)
            process = peers.processes[index]
            assert process is not None
            process.stop()  # SIGTERM: in order
            peers.start(index)
    assert not load.errors, load.errors
    load.check_spawned()


def _app_holders(peers: Peers) -> dict[str, int]:
    """app -> the index of the process whose live lease owns it."""
    with psycopg.connect(peers.database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, holder_url FROM leases WHERE name LIKE 'app:%' "
            "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
        ).fetchall()
    return {str(name).removeprefix("app:"): peers.urls.index(str(url)) for name, url in rows}


def _spread(peers: Peers) -> list[int]:
    counts = [0, 0, 0]
    for index in _app_holders(peers).values():
        counts[index] += 1
    return counts


def _balanced(peers: Peers, apps: set[str], live: set[int]) -> bool:
    """Every app owned, by live processes only, their counts at most one apart."""
    counts = _spread(peers)
    shares = [counts[i] for i in sorted(live)]
    return (
        set(_app_holders(peers)) == apps
        and sum(counts) == sum(shares)
        and max(shares) - min(shares) <= 1
    )


def test_the_apps_spread_over_every_process_and_move_when_one_goes(peers: Peers) -> None:
    """Each app is owned by one live process, spread evenly; a process killed has its
    apps taken over within its lease's time, a restarted one gets its share back, and
    one stopped in order gives its apps up as it stops."""
    small = peers.root / "small" / "app.py"
    small.parent.mkdir()
    small.write_text("import ember\n\n\n@ember.endpoint()\ndef noop() -> dict:\n    return {}\n")
    for i in range(4):
        peers.first.deploy(small, f"spread{i}")
    with peers.first.client() as client:
        apps = {row["app"] for row in client.get("/v1/apps").json()["endpoints"]}
    assert len(apps) >= 5
    everyone = {0, 1, 2}
    wait_for(lambda: _balanced(peers, apps, everyone), 15)

    victim = next(i for i in range(3) if i != peers.owner())
    process = peers.processes[victim]
    assert process is not None and process.process is not None
    theirs = {app for app, index in _app_holders(peers).items() if index == victim}
    os.killpg(process.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: _balanced(peers, apps, everyone - {victim}), 15)
    moved_in = time.monotonic() - killed_at
    print(f"the killed process's apps {sorted(theirs)} owned again after {moved_in:.2f} s")

    peers.start(victim)  # back: it gets its share as the others give theirs up
    wait_for(lambda: _balanced(peers, apps, everyone), 15)

    stopping = peers.processes[victim]
    assert stopping is not None
    stopping.stop()  # SIGTERM: in order, its leases given up as it goes
    with psycopg.connect(peers.database, autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM leases WHERE holder_url = %s AND name LIKE 'app:%%' "
            "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())",
            (peers.urls[victim],),
        ).fetchone()
    assert left == (0,)
    wait_for(lambda: _balanced(peers, apps, everyone - {victim}), 5)
    peers.start(victim)
    wait_for(lambda: _balanced(peers, apps, everyone), 15)
