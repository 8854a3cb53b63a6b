"""User code that dies mid-input or cannot start gets a clear error and loses nothing else."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, running_platform, wait_for
from machine_needs import need

import ember

APP = "broken"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "broken.py", APP)


def test_replica_dying_mid_input_is_retried_then_fails_with_502(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        response = client.post(f"/{APP}--crashy/", json={})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "replica_lost"
    assert "2 attempts" in error["message"]


def test_an_input_that_crashes_a_shared_replica_fails_alone(
    platform: Platform, deployed: dict[str, str]
) -> None:
    shared = ember.Endpoint.lookup(APP, "shared", config=platform.config())
    shared.call()  # its replica up first, so that all four run on it together
    results = list(
        shared.map([{"crash": True}, *({"seconds": 1.0} for _ in range(3))], return_exceptions=True)
    )
    poison, *neighbours = results
    assert isinstance(poison, ember.RemoteError) and poison.status == 502
    assert "gave up after 2 attempts (retries=1)" in poison.message
    assert neighbours == [{"slept": 1.0}] * 3


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("unloadable", "RuntimeError: weights missing"),
        ("unready", "ConnectionError: database down"),
        ("sluggish", "not ready after 1 s (startup_timeout)"),
    ],
)
def test_replica_that_cannot_start_fails_the_input_with_the_reason(
    platform: Platform, deployed: dict[str, str], endpoint: str, expected: str
) -> None:
    with platform.client(timeout=120) as client:
        response = client.post(f"/{APP}--{endpoint}/run", json={})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "replica_start_failed"
    assert expected in error["message"]
    row = platform.endpoint_status(f"{APP}--{endpoint}")
    assert expected in row["last_startup_error"]
    logs = platform.ember("logs", f"{APP}/{endpoint}").stdout
    assert expected in logs
    listed = platform.ember("ls", APP).stdout
    row = next(line for line in listed.splitlines() if line.startswith(f"{APP}--{endpoint} "))
    assert "FAILS TO START: " in row and expected in row, listed
    # Code that raised left its traceback; a replica killed for its time left none.
    assert ("Traceback" in logs) == (endpoint != "sluggish")


@pytest.fixture
def small_memory_cgroup() -> Iterator[Path]:
    """A memory cgroup of 128 MiB (cgroup v1 or v2); yields its `cgroup.procs` file."""
    if os.geteuid() != 0:
        need("root", "making a cgroup needs root")
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    name = f"ember-test-{secrets.token_hex(4)}"
    limit = str(128 << 20)
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            group = v1 / name
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(limit)
        elif "memory" in (v2 / "cgroup.controllers").read_text().split():
            group = v2 / name
            group.mkdir()
            (group / "memory.max").write_text(limit)
            (group / "memory.swap.max").write_text("0")
        else:
            need("cgroups", "no memory cgroup controller")
    except OSError as error:
        need("cgroups", f"cannot make a memory cgroup: {error}")
    procs = group / "cgroup.procs"  # the test moves the replica in, as root
    try:
        yield procs
    finally:
        for _ in range(50):  # the killed replica leaves it in a moment
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_replica_the_oom_killer_ends_is_said_to_have_run_out_of_memory(
    platform: Platform,
    deployed: dict[str, str],
    small_memory_cgroup: Path,
    replica_writable: Path,
) -> None:
    # The replica tells its PID through a shared folder; the test (root) moves it into the
    # small cgroup: in its sandbox it sees no cgroup file of the node's.
    body = {"procs_file": "/dev/null", "mb": 512, "handshake": str(replica_writable)}
    with platform.client(timeout=120) as client, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, f"/{APP}--hog/", json=body)
        pid = wait_for(lambda: (f := replica_writable / "pid").exists() and f.read_text(), 120)
        small_memory_cgroup.write_text(pid)
        (replica_writable / "moved").touch()
        response = answer.result(timeout=120)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "replica_lost"
    assert "killed by the kernel's OOM killer" in error["message"]
    assert "the endpoint asks for memory=512 (MiB)" in error["message"]  # the default
    logs = platform.ember("logs", f"{APP}/hog").stdout
    assert "OOM killer" in logs and "memory=" in logs
    # The platform lives on: the next input gets a fresh replica.
    with platform.client(timeout=120) as client:
        response = client.post(f"/{APP}--hog/", json={"procs_file": "/dev/null", "mb": 1})
    assert response.status_code == 200 and response.json() == {"held_mb": 1}


def test_a_replica_using_more_memory_than_it_asks_for_is_told_so(
    platform: Platform, deployed: dict[str, str]
) -> None:
    hog = ember.Endpoint.lookup(APP, "hog", config=platform.config())
    # Its replica up first: the waits below are for the measures, not a cold boot too.
    assert hog.call(procs_file="/dev/null", mb=1) == {"held_mb": 1}
    # Held for longer than two of the agent's measures (every 5 s), checked meanwhile.
    call = hog.spawn(procs_file="/dev/null", mb=700, hold_seconds=12.0)
    logs = wait_for(
        lambda: (out := platform.ember("logs", f"{APP}/hog").stdout) and "more than" in out and out,
        15,
    )
    assert "more than the memory=512 (MiB) its endpoint asks for" in logs

    # The same measure, in `ember ls` (about 700 of the 512 MiB it asks for), once the
    # worker's next heartbeat has brought it ...
    def hog_memory() -> int:
        row = next(line for line in platform.ember("ls").stdout.splitlines() if "--hog" in line)
        return int(row.split("mem ", 1)[1].split("/", 1)[0]) if "mem " in row else 0

    # (an earlier heartbeat may still carry a measure from before it filled its memory)
    assert 650 < wait_for(lambda: (used := hog_memory()) > 650 and used, 10) < 900
    # ... and in the metrics.
    token = platform.ember("token", "create", "--scope", "metrics").stdout.strip()
    with platform.client(token=token) as client:
        text = client.get("/metrics").text
    assert f'ember:replica_memory_bytes{{app="{APP}",endpoint="hog",replica=' in text
    assert call.get(timeout=60) == {"held_mb": 700}


def test_code_that_raises_is_retried_with_retries_and_then_its_error_reaches_the_caller(
    platform: Platform, deployed: dict[str, str]
) -> None:
    flaky = ember.Endpoint.lookup(APP, "flaky", config=platform.config())
    assert flaky.call(key="twice", failures=2) == {"key": "twice", "calls": 3}
    with pytest.raises(ember.UserCodeError, match=r"upstream down \(call 3\)"):
        flaky.call(key="always", failures=10)
    # Spawned calls too; their result waits for the retries.
    assert flaky.spawn(key="once", failures=1).get(timeout=60) == {"key": "once", "calls": 2}
    logs = platform.ember("logs", f"{APP}/flaky").stdout
    first = "raised ConnectionError: upstream down (call 1); retrying in 0.2 s (retry 1 of 2)"
    assert first in logs
    assert "retrying in 0.4 s (retry 2 of 2)" in logs


STUBBORN_APP = """
import time

import ember


@ember.endpoint(snapshot=False)
class Stubborn:
    @ember.method()
    def hello(self) -> str:
        return "hi"

    @ember.exit
    def close(self) -> None:
        print("closing", flush=True)
        time.sleep(3600)
"""


def test_a_replica_killed_after_its_stop_grace_says_so_in_its_log(tmp_path: Path) -> None:
    app = tmp_path / "stubborn.py"
    app.write_text(STUBBORN_APP)
    with running_platform(tmp_path / "cp", extra=("--stop-grace", "1")) as platform:
        platform.deploy(app, "stubborn")
        stubborn = ember.Endpoint.lookup("stubborn", "stubborn", config=platform.config())
        assert stubborn.method("hello").call() == "hi"
        [replica] = json.loads(platform.ember("replica", "ls", "stubborn", "--json").stdout)
        platform.ember("replica", "stop", replica["id"])
        logs = wait_for(
            lambda: "SIGKILL" in (out := platform.ember("logs", "stubborn").stdout) and out, 30
        )
        assert "closing" in logs
        assert "still running 1 s after it was asked to stop" in logs
