"""A cron schedule (`ember.Cron`): the platform calls the endpoint for the next minute its
expression names, and says when the run after that is due. The control plane starts runs
a minute before their due time (`EMBER_SCHEDULE_LEAD_SECONDS`), so the test need not
wait for that minute: the run is still the one due then, and the next is due a minute
later (tests/unit/test_scheduled_runs.py drives the times themselves with a scripted
clock)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, running_platform, wait_for

from ember_platform.calls.schedules import LEAD_ENV

APP = "cronned"
LEAD = 60.0  # seconds before its due time a run starts
SOURCE = """
import time

import ember


@ember.endpoint(schedule=ember.Cron("* * * * *"), scaledown_window=30.0)
def minutely() -> dict:
    print("minutely ran")
    return {"ran_at": time.time()}
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("platform")
    with running_platform(root, env={LEAD_ENV: f"{LEAD:g}"}) as running:
        yield running


def _schedule(platform: Platform) -> dict[str, Any]:
    return platform.endpoint_status(f"{APP}--minutely")["schedule"]


def test_a_cron_schedule_runs_the_endpoint_at_the_next_minute(
    platform: Platform, tmp_path: Path
) -> None:
    source = tmp_path / "cronned.py"
    source.write_text(SOURCE)
    first_minute = (int(time.time()) // 60 + 1) * 60  # the earliest time due
    platform.deploy(source, APP)
    schedule = _schedule(platform)
    assert schedule["schedule"] == "cron '* * * * *' (UTC)"
    due = schedule["next_run_at"]
    assert due is not None and due % 60 == 0 and due >= first_minute  # on a minute

    def succeeded() -> dict[str, Any] | None:
        last = _schedule(platform)["last_run"]
        return last if last and last.get("status") == "succeeded" else None

    # The minute's run, with room for a loaded machine to start its replica.
    run = wait_for(succeeded, 61 + 120, interval=0.2)
    assert run["due_at"] % 60 == 0 and run["due_at"] >= first_minute
    result = json.loads(platform.ember("calls", "get", run["call_id"]).stdout)
    assert result["ran_at"] >= run["due_at"] - LEAD  # no earlier than the lead allows
    after = _schedule(platform)["next_run_at"]
    assert after is not None and after % 60 == 0 and after >= run["due_at"] + 60
    logs = platform.ember("logs", f"{APP}/minutely").stdout
    assert "schedule: started run c-s" in logs and "minutely ran" in logs
    platform.ember("stop", APP)
