"""`@ember.health_check`: its settings are checked when the class is defined, a replica's
monitor tells a passing check from one that raises or hangs, and the control plane
replaces a replica that reports itself unhealthy."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import Env, run

import ember
from ember.endpoints.health import HealthCheck
from ember.errors import InvalidError
from ember_platform.runtime.cluster_model import ReplicaState
from ember_worker.replica.health_checks import HealthMonitor

# --- the marker ---------------------------------------------------------------------------


def test_a_class_endpoint_records_its_one_health_check() -> None:
    @ember.endpoint()
    class Model:
        @ember.method
        def run(self) -> int:
            return 1

        @ember.health_check(period=5, timeout=2.5, failures=1)
        def alive(self) -> None:
            pass

    assert Model.health_check == ("alive", HealthCheck(5.0, 2.5, 1))

    @ember.endpoint()
    class Plain:
        @ember.method
        def run(self) -> int:
            return 1

        @ember.health_check
        def alive(self) -> None:
            pass

    assert Plain.health_check == ("alive", HealthCheck(10.0, 10.0, 3))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"period": 0}, r"period=0\) is out of range"),
        ({"timeout": "5"}, r"timeout=...\) takes seconds"),
        ({"failures": 0}, "failures=...\\) takes a whole number from 1 to 100, not 0"),
        ({"failures": 2.0}, "takes a whole number"),
    ],
)
def test_bad_settings_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        ember.health_check(**options)


def test_misplaced_health_checks_are_refused() -> None:
    with pytest.raises(InvalidError, match="goes on a method of a class endpoint"):

        @ember.endpoint()
        @ember.health_check
        def fn() -> None:
            pass

    with pytest.raises(InvalidError, match="is called with no arguments, but it needs"):

        class Needy:
            @ember.health_check
            def check(self, deep: bool) -> None:
                pass

    with pytest.raises(InvalidError, match="has several health checks"):

        @ember.endpoint()
        class Two:
            @ember.method
            def run(self) -> int:
                return 1

            @ember.health_check
            def one(self) -> None:
                pass

            @ember.health_check
            def other(self) -> None:
                pass


# --- the replica's monitor ----------------------------------------------------------------


def _monitor(hook: Any, failures: int = 2, timeout: float = 0.2) -> tuple[HealthMonitor, list[str]]:
    """A monitor checking every 50 ms; the tests of checks that return, rather than hang,
    give a timeout a loaded machine cannot reach (a thread of its own runs a sync check)."""
    reports: list[str] = []

    async def report(reason: str) -> None:
        reports.append(reason)

    return HealthMonitor("check", hook, HealthCheck(0.05, timeout, failures), report), reports


def test_a_passing_check_never_reports() -> None:
    calls: list[int] = []
    monitor, reports = _monitor(lambda: calls.append(1), timeout=10)

    async def scenario() -> None:
        task = asyncio.ensure_future(monitor.run())
        while len(calls) < 3:  # however slowly a loaded machine runs them
            await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert len(calls) >= 3 and reports == []


def test_failures_in_a_row_report_and_a_pass_between_resets_the_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    outcomes = iter([False, True, False, False])

    def hook() -> None:
        if not next(outcomes):
            raise OSError("CUDA error: an illegal memory access")

    monitor, reports = _monitor(hook, timeout=10)
    asyncio.run(asyncio.wait_for(monitor.run(), 30))
    assert reports == ["OSError: CUDA error: an illegal memory access"]
    said = capsys.readouterr().err
    assert said.count("failed (1 of 2 in a row)") == 2
    assert "passed again after 1 failure(s)" in said


def test_a_hung_check_times_out_and_is_not_started_twice() -> None:
    release = threading.Event()
    started: list[float] = []

    def hook() -> None:
        started.append(time.monotonic())
        release.wait(10)

    monitor, reports = _monitor(hook)
    try:
        asyncio.run(asyncio.wait_for(monitor.run(), 5))
    finally:
        release.set()
    assert len(started) == 1
    assert reports[0].startswith("the check started ") and reports[0].endswith("has not returned")


def test_an_async_check_that_hangs_times_out() -> None:
    async def hook() -> None:
        await asyncio.sleep(10)

    monitor, reports = _monitor(hook, failures=1)
    asyncio.run(asyncio.wait_for(monitor.run(), 5))
    assert reports == ["it did not return within 0.2 s"]


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()])
def test_a_check_that_exits_or_interrupts_is_a_failed_check_not_a_dead_replica(
    raised: BaseException,
) -> None:
    def hook() -> None:
        raise raised

    async def async_hook() -> None:
        raise raised

    for check in (hook, async_hook):
        monitor, reports = _monitor(check, failures=1, timeout=10)
        asyncio.run(asyncio.wait_for(monitor.run(), 10))
        assert reports == [f"{type(raised).__name__}: {raised}"]


# --- the control plane --------------------------------------------------------------------


def test_an_unhealthy_replica_drains_and_a_replacement_starts(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1, concurrency=2)
        (sick,) = env.start_ready()
        running = env.submit()
        assert running.replica_id == sick.id
        env.cluster.wake.clear()
        env.reply(sick, "unhealthy", reason="RuntimeError: the GPU fell off the bus")
        assert sick.state is ReplicaState.DRAINING
        assert env.cluster.wake.is_set()
        assert (
            "replica is unhealthy (RuntimeError: the GPU fell off the bus); replacing it, "
            "after the 1 input(s) it runs" in env.logs()
        )
        (replacement,) = env.start_ready()
        queued = env.submit()
        assert queued.replica_id == replacement.id  # the sick one takes no more
        env.reply(sick, "result", running, b"1")  # its last input still answers
        assert sick.state is ReplicaState.STOPPING
        assert env.runtime.last_unhealthy is not None
        assert env.runtime.last_unhealthy["replica"] == sick.id
        # A second report changes nothing.
        env.reply(sick, "unhealthy", reason="again")
        assert "again" not in env.logs()

    run(tmp_path, scenario)
