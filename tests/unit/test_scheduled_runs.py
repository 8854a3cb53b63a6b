"""The control plane's scheduled runs, driven by `Controller.tick(now)` on a real `Cluster`
(the harness of test_cluster): due times, one run per due time across a restart, the
catch-up window, and skipping while the previous run still waits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cluster_harness import APP, DIGEST, ENDPOINT, ENTRY, LABEL, Env, make_env

from ember.declarations.schedules import Period
from ember.declarations.settings import EndpointSettings
from ember.wire.spec import FUNCTION_METHOD, AppManifest, EndpointSpec, MethodSpec
from ember_platform.calls.schedules import (
    CATCH_UP_SECONDS,
    LEAD_ENV,
    lead_seconds,
    scheduled_call_id,
)
from ember_platform.storage.records import Deployment

# Near the real clock: records of calls are kept for a day of it.
DEPLOYED_AT = float(int(time.time()) // 3600 * 3600)
EVERY = 10.0


def scheduled_deployment(every: float = EVERY) -> Deployment:
    spec = EndpointSpec(
        name=ENDPOINT,
        attribute="fn",
        kind="function",
        settings=EndpointSettings(schedule=Period(seconds=every).to_dict()),
        methods={FUNCTION_METHOD: MethodSpec(FUNCTION_METHOD, streaming=False, is_async=False)},
    )
    manifest = AppManifest(app=APP, entry=ENTRY, endpoints=[spec])
    return Deployment(APP, 1, DIGEST, manifest.to_dict(), DEPLOYED_AT)


def run_ids(env: Env) -> list[str]:
    return sorted(i for i in env.cluster.inputs if i.startswith("c-s"))


def in_loop(tmp_path: Path, body) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        await body()

    asyncio.run(main())


def test_a_run_starts_at_each_due_time_and_only_once(tmp_path: Path) -> None:
    async def body() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment())
        env.advance(DEPLOYED_AT + 5)
        assert run_ids(env) == []
        env.advance(DEPLOYED_AT + EVERY + 0.2)
        first = scheduled_call_id(LABEL, DEPLOYED_AT + EVERY)
        assert run_ids(env) == [first]
        assert env.cluster.inputs[first].is_async and env.cluster.inputs[first].body == b"{}"
        env.advance(DEPLOYED_AT + EVERY + 0.8)
        assert run_ids(env) == [first]
        assert env.runtime.next_run_at == DEPLOYED_AT + 2 * EVERY
        assert "schedule: started run " + first in env.logs()
        env.store.close()

    in_loop(tmp_path, body)


def test_a_restarted_control_plane_does_not_run_a_due_time_again(tmp_path: Path) -> None:
    due = DEPLOYED_AT + EVERY
    call_id = scheduled_call_id(LABEL, due)

    async def before_restart() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment())
        env.advance(due + 0.1)
        assert run_ids(env) == [call_id]
        env.store.close()

    async def after_restart() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment())  # as `ember server` starts
        env.cluster.input_lifecycle.recover_calls()
        env.advance(due + 5)  # within the catch-up window: looked at again
        assert env.cluster.calls.get(call_id) is not None
        assert [i for i in env.cluster.inputs if i == call_id] == [call_id]  # recovered, once
        assert env.logs().count("schedule: started run " + call_id) == 1
        env.store.close()

    in_loop(tmp_path, before_restart)
    in_loop(tmp_path, after_restart)


def test_a_time_missed_while_down_runs_only_within_the_catch_up_window(tmp_path: Path) -> None:
    async def body() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment(every=600))
        # Up 30 s after the due time: it still runs.
        env.advance(DEPLOYED_AT + 630)
        assert run_ids(env) == [scheduled_call_id(LABEL, DEPLOYED_AT + 600)]
        env.store.close()

    async def too_late() -> None:
        env = make_env(tmp_path / "late")
        env.cluster.deployments.apply(scheduled_deployment(every=600))
        env.advance(DEPLOYED_AT + 600 + CATCH_UP_SECONDS + 30)
        assert run_ids(env) == []
        assert env.runtime.next_run_at == DEPLOYED_AT + 1200
        env.store.close()

    (tmp_path / "late").mkdir()
    in_loop(tmp_path, body)
    in_loop(tmp_path, too_late)


def test_a_run_is_skipped_while_the_previous_one_has_not_started(tmp_path: Path) -> None:
    async def body() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment())
        env.advance(DEPLOYED_AT + EVERY + 0.1)  # queued; its replica never becomes ready
        env.advance(DEPLOYED_AT + 2 * EVERY + 0.1)
        assert run_ids(env) == [scheduled_call_id(LABEL, DEPLOYED_AT + EVERY)]
        assert "has not started yet" in env.logs()
        metric = env.cluster.metrics.scheduled_runs.labels(APP, ENDPOINT, "skipped")
        assert metric._value.get() == 1
        env.store.close()

    in_loop(tmp_path, body)


def test_a_late_tick_runs_once_for_the_times_it_missed(tmp_path: Path) -> None:
    async def body() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment())
        env.advance(DEPLOYED_AT + 1)
        env.advance(DEPLOYED_AT + 3 * EVERY + 1)  # the loop stalled over two due times
        # The latest of the times it missed: the earlier ones would run later still.
        assert run_ids(env) == [scheduled_call_id(LABEL, DEPLOYED_AT + 3 * EVERY)]
        assert env.runtime.next_run_at == DEPLOYED_AT + 4 * EVERY
        assert "are late; running the one due at" in env.logs()
        env.store.close()

    in_loop(tmp_path, body)


def test_a_restart_runs_the_latest_time_it_missed_of_a_schedule_under_a_minute(
    tmp_path: Path,
) -> None:
    every = 20.0
    ran = scheduled_call_id(LABEL, DEPLOYED_AT + every)

    async def before_restart() -> None:
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment(every=every))
        env.advance(DEPLOYED_AT + every + 0.1)
        assert run_ids(env) == [ran]
        env.store.close()

    async def after_restart() -> None:
        # Down from just after that run until 45 s later: the runs due at +40 and +60 were
        # missed; the first time of the catch-up window (+20) ran before the restart.
        env = make_env(tmp_path)
        env.cluster.deployments.apply(scheduled_deployment(every=every))
        env.cluster.input_lifecycle.recover_calls()
        env.advance(DEPLOYED_AT + every + 45)
        assert run_ids(env) == sorted([ran, scheduled_call_id(LABEL, DEPLOYED_AT + 3 * every)])
        assert "running the one due at" in env.logs()
        env.store.close()

    in_loop(tmp_path, before_restart)
    in_loop(tmp_path, after_restart)


def test_a_lead_starts_each_run_that_long_before_its_due_time(tmp_path: Path) -> None:
    async def body() -> None:
        env = make_env(tmp_path)
        env.controller.schedule_lead = 3.0
        env.cluster.deployments.apply(scheduled_deployment())
        env.advance(DEPLOYED_AT + EVERY - 3.5)
        assert run_ids(env) == []
        env.advance(DEPLOYED_AT + EVERY - 2.9)  # the run due at +EVERY, 2.9 s early
        assert run_ids(env) == [scheduled_call_id(LABEL, DEPLOYED_AT + EVERY)]
        assert env.runtime.next_run_at == DEPLOYED_AT + 2 * EVERY
        env.store.close()

    in_loop(tmp_path, body)


def test_the_lead_is_read_from_the_environment_within_a_minute() -> None:
    assert lead_seconds({}) == 0.0
    assert lead_seconds({LEAD_ENV: "2.5"}) == 2.5
    assert lead_seconds({LEAD_ENV: "600"}) == 60.0
    assert lead_seconds({LEAD_ENV: "-1"}) == 0.0
    assert lead_seconds({LEAD_ENV: "soon"}) == 0.0
    assert lead_seconds({LEAD_ENV: "nan"}) == 0.0
