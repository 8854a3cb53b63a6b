"""`@ember.health_check`: a replica whose check fails, by raising or by hanging, is
replaced: it finishes the inputs it runs, stops, and a new replica serves the next ones;
the logs, `ember ls` and /metrics say so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from harness import Platform, wait_for

import ember

APP = "ailing"
LABEL = f"{APP}--ailing"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "ailing.py", APP)


def _logs(platform: Platform) -> str:
    return platform.ember("logs", APP, "-n", "1000").stdout


def test_a_check_that_raises_replaces_the_replica_after_its_inputs_finish(
    platform: Platform, deployed: dict[str, str]
) -> None:
    endpoint = ember.Endpoint.lookup(APP, "ailing", config=platform.config())
    sick = endpoint.pid.call()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(endpoint.slow.call, seconds=3.0)
        wait_for(lambda: platform.endpoint_status(LABEL)["running"] == 1, 10)
        endpoint.sicken.call(how="raises")
        wait_for(lambda: "replica is unhealthy" in _logs(platform), 15)
        # Drained, not killed: the input it ran when it failed still gets its answer.
        assert running.result(30) == sick
    logs = _logs(platform)
    assert "health check check failed (1 of 2 in a row): RuntimeError: the GPU fell off" in logs
    assert "replica is unhealthy (RuntimeError: the GPU fell off the bus); replacing it" in logs
    assert endpoint.pid.call() != sick
    wait_for(lambda: not psutil.pid_exists(sick), 30)
    listed = platform.ember("ls").stdout
    assert "last unhealthy: r-" in listed
    with platform.client() as client:
        metrics = client.get("/metrics").text
    assert f'ember:replicas_unhealthy_total{{app="{APP}",endpoint="ailing"}} 1.0' in metrics


def test_a_check_that_hangs_fails_on_its_timeout_and_the_replica_still_stops(
    platform: Platform, deployed: dict[str, str]
) -> None:
    endpoint = ember.Endpoint.lookup(APP, "ailing", config=platform.config())
    sick = endpoint.pid.call()
    endpoint.sicken.call(how="hangs")
    wait_for(lambda: "has not returned" in _logs(platform), 15)
    assert "failed (1 of 2 in a row): it did not return within 0.5 s" in _logs(platform)
    assert endpoint.pid.call() != sick  # a new replica
    # The hung check's thread does not hold the old process up past its exit hooks.
    wait_for(lambda: not psutil.pid_exists(sick), 15)
