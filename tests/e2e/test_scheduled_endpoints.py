"""Scheduled endpoints: the platform calls them at their times, says so, and skips a run
while the one before it still waits for a replica."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, wait_for

APP = "sched"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "scheduled.py", APP)


def _schedule(platform: Platform, endpoint: str) -> dict[str, Any]:
    return platform.endpoint_status(f"{APP}--{endpoint}")["schedule"]


def test_a_period_runs_the_endpoint_again_and_again(
    platform: Platform, deployed: dict[str, str]
) -> None:
    runs: set[str] = set()

    def two_runs_done() -> bool:
        last = _schedule(platform, "tick")["last_run"]
        if last and last.get("status") == "succeeded":
            runs.add(last["call_id"])
        return len(runs) >= 2

    wait_for(two_runs_done, 60, interval=0.2)
    call_id = sorted(runs)[0]
    result = json.loads(platform.ember("calls", "get", call_id).stdout)
    assert result["label"] == "scheduled"
    listed = json.loads(platform.ember("calls", "ls", f"{APP}/tick", "--json").stdout)
    assert runs <= {c["call_id"] for c in listed}
    schedule = _schedule(platform, "tick")
    assert schedule["schedule"] == "every 2s"
    assert schedule["next_run_at"] is not None
    listing = platform.ember("ls").stdout
    assert "scheduled:" in listing and f"{APP}--tick" in listing and "every 2s" in listing
    logs = platform.ember("logs", f"{APP}/tick").stdout
    assert "schedule: started run c-s" in logs and "tick ran: scheduled" in logs
    with platform.client() as client:
        metrics = client.get("/metrics").text
    series = f'ember:scheduled_runs_total{{app="{APP}",endpoint="tick",outcome="started"}} '
    lines = metrics.splitlines()
    started = [float(line[len(series) :]) for line in lines if line.startswith(series)]
    assert started and started[0] >= 2


def test_a_run_is_skipped_while_the_one_before_still_waits(
    platform: Platform, deployed: dict[str, str]
) -> None:
    # Every second, but one replica runs one input for 2.5 s: runs queue, and a run due
    # while the previous one is still queued is skipped rather than piled up.
    wait_for(lambda: "has not started yet" in platform.ember("logs", f"{APP}/slow").stdout, 60)
    status = platform.endpoint_status(f"{APP}--slow")
    assert status["queued"] <= 1


def test_stopping_the_app_stops_its_schedule(platform: Platform, deployed: dict[str, str]) -> None:
    platform.ember("stop", APP)
    assert all(e["app"] != APP for e in platform.status()["endpoints"])

    def runs_started() -> int:
        return platform.ember("logs", f"{APP}/tick").stdout.count("schedule: started run")

    before = runs_started()
    time.sleep(4.5)  # two periods of `tick`
    assert runs_started() == before
