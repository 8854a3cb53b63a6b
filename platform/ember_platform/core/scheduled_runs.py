"""Scheduled endpoints: at each due time, a spawned call with no arguments (the due times
and call ids: calls/schedules.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ember.wire.spec import FUNCTION_METHOD
from ember_platform.calls.schedules import first_due, latest_due, scheduled_call_id, utc_text
from ember_platform.errors import PlatformError
from ember_platform.runtime.inputs import Input

if TYPE_CHECKING:
    from ember_platform.core.cluster import Cluster
    from ember_platform.runtime.cluster_model import EndpointRuntime

log = logging.getLogger("ember.endpoints.schedules")


def run_due(cluster: Cluster, now: float) -> None:
    """Start the runs of every scheduled endpoint that have fallen due."""
    for runtime in list(cluster.endpoints.values()):
        if runtime.schedule_version != runtime.version:
            runtime.schedule_version = runtime.version
            runtime.schedule = runtime.settings.parsed_schedule
            runtime.next_run_at = None
            if runtime.schedule is not None:
                runtime.next_run_at = first_due(runtime.schedule, runtime, now)
        schedule = runtime.schedule
        if schedule is None:
            continue
        due_at = runtime.next_run_at
        if due_at is None or due_at > now:
            continue
        runtime.next_run_at = schedule.next_after(now, runtime.deployed_at)
        latest = latest_due(schedule, runtime, due_at, now)
        if already_started(cluster, runtime, latest):
            continue  # before a restart of the control plane: nothing was missed
        if latest != due_at:
            say(
                cluster,
                runtime,
                f"schedule: the runs due from {utc_text(due_at)} until now are late; "
                f"running the one due at {utc_text(latest)}",
            )
        start_run(cluster, runtime, latest)


def already_started(cluster: Cluster, runtime: EndpointRuntime, due_at: float) -> bool:
    call_id = scheduled_call_id(runtime.label, due_at)
    return call_id in cluster.inputs or cluster.calls.get(call_id) is not None


def start_run(cluster: Cluster, runtime: EndpointRuntime, due_at: float) -> None:
    call_id = scheduled_call_id(runtime.label, due_at)
    if already_started(cluster, runtime, due_at):
        return  # started before a restart of the control plane
    previous = cluster.inputs.get(runtime.last_run.get("call_id", "")) if runtime.last_run else None
    if previous is not None and previous.dispatched_at is None:
        cluster.metrics.scheduled_run(runtime.app, runtime.spec.name, "skipped")
        say(
            cluster,
            runtime,
            f"schedule: skipped the run due at {utc_text(due_at)}: the previous run "
            f"({previous.id}) has not started yet",
        )
        return
    run = Input(
        id=call_id,
        label=runtime.label,
        method=FUNCTION_METHOD,
        body=b"{}",
        streaming=False,
        is_async=True,
    )
    try:
        cluster.input_lifecycle.submit(run)
    except PlatformError as error:  # its queue is full, or its record could not be kept
        cluster.metrics.scheduled_run(runtime.app, runtime.spec.name, "skipped")
        refused = f"schedule: the run due at {utc_text(due_at)} was not started: {error.message}"
        say(cluster, runtime, refused)
        return
    runtime.last_run = {"call_id": call_id, "due_at": due_at, "started_at": run.created_at}
    cluster.metrics.scheduled_run(runtime.app, runtime.spec.name, "started")
    say(cluster, runtime, f"schedule: started run {call_id} (due at {utc_text(due_at)})")


def say(cluster: Cluster, runtime: EndpointRuntime, message: str) -> None:
    log.info("%s: %s", runtime.label, message)
    cluster.logs.system(runtime.app, runtime.spec.name, message)


def schedule_status(cluster: Cluster, runtime: EndpointRuntime) -> dict[str, Any] | None:
    """What `ember ls` shows of a scheduled endpoint: its schedule, its next run, and its
    last run with that call's status."""
    current = runtime.schedule_version == runtime.version  # run_due has read it
    schedule = runtime.schedule if current else runtime.settings.parsed_schedule
    if schedule is None:
        return None
    last = None
    if runtime.last_run is not None:
        last = dict(runtime.last_run)
        live = cluster.inputs.get(last["call_id"])
        record = None if live is not None else cluster.calls.get(last["call_id"])
        if live is not None:
            last["status"] = "running" if live.dispatched_at is not None else "queued"
        elif record is not None:
            last["status"] = record.status.value
            last["http_status"] = record.http_status
    return {"schedule": str(schedule), "next_run_at": runtime.next_run_at, "last_run": last}
