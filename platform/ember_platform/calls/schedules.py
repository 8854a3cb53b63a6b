"""Scheduled endpoints' due times: when a run falls due, which missed one runs, and the
call id each run takes (core/scheduled_runs.py starts them).

A run's call id is a digest of the endpoint and its due time, so a due time runs once
even when a control plane that restarted (its calls are in the store) looks at it
again. After a restart, a time that fell due in the last minute still runs; older
missed times do not (as with cron, nothing is made up for a machine that was off)."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ember.declarations.schedules import Schedule

if TYPE_CHECKING:
    from ember_platform.runtime.cluster_model import EndpointRuntime

CATCH_UP_SECONDS = 60.0
MAX_MISSED_STEPS = 100_000  # times looked past to find the latest missed one
# Seconds before their due times that runs start (0 to 60; default 0): for tests and
# demos that cannot wait for a cron expression's next minute. A run keeps its due time.
LEAD_ENV = "EMBER_SCHEDULE_LEAD_SECONDS"
MAX_LEAD_SECONDS = 60.0


def lead_seconds(environ: Mapping[str, str]) -> float:
    """The lead `environ` asks for, within 0 to a minute; 0 when it asks for none."""
    try:
        asked = float(environ.get(LEAD_ENV, ""))
    except ValueError:
        return 0.0
    return min(max(asked, 0.0), MAX_LEAD_SECONDS) if math.isfinite(asked) else 0.0


def scheduled_call_id(label: str, due_at: float) -> str:
    digest = hashlib.sha256(f"schedule\0{label}\0{due_at:.3f}".encode()).digest()
    return "c-s" + base64.urlsafe_b64encode(digest[:15]).decode()


def utc_text(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def first_due(schedule: Schedule, runtime: EndpointRuntime, now: float) -> float | None:
    """When a newly seen deployment first runs: after it was deployed, and no earlier
    than a minute ago (a restarted control plane catches the time it just missed)."""
    since = max(runtime.deployed_at, now - CATCH_UP_SECONDS)
    return schedule.next_after(since, runtime.deployed_at)


def latest_due(schedule: Schedule, runtime: EndpointRuntime, due_at: float, now: float) -> float:
    """The last time due by `now`, from `due_at` on: of runs missed (the control plane was
    down, or busy), the latest is the one to run; the earlier ones may have run already."""
    latest = due_at
    for _ in range(MAX_MISSED_STEPS):
        following = schedule.next_after(latest, runtime.deployed_at)
        if following is None or following > now:
            break
        latest = following
    return latest
