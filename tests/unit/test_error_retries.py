"""`retries=ember.Retries(...)`: inputs whose code raised run again after a growing delay,
until their retries are spent; what a retry cannot mend, or a caller who left, ends it.
Driven on a real `Cluster` (the harness of test_cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cluster_harness import Env, error_of, outcome_of, run

from ember.declarations.retries import Retries, retry_delay
from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember_platform.storage.records import CallStatus

FAST = Retries(max_retries=2, initial_delay=0.02, backoff_coefficient=2.0).backoff()


def raised(env: Env, replica, inp, error_type: str = "ValueError") -> None:  # type: ignore[no-untyped-def]
    env.reply(replica, "error", inp, status=500, error_type=error_type, message="boom")


def test_an_input_that_raised_runs_again_after_its_backoff_then_succeeds(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=2, retry_backoff=FAST)
        inp = env.submit()
        (replica,) = env.start_ready()
        assert env.inputs_sent(replica) == [inp.id]
        raised(env, replica, inp)
        assert not inp.done and not env.runtime.pending  # waiting out its delay
        await asyncio.sleep(0.05)
        assert env.inputs_sent(replica) == [inp.id]  # the same replica takes it again
        assert inp.attempts == 2
        env.reply(replica, "result", inp, b'{"ok": true}')
        assert outcome_of(inp).status == 200
        assert "raised ValueError: boom; retrying in 0.02 s (retry 1 of 2)" in env.logs()

    run(tmp_path, scenario)


def test_an_input_fails_with_its_own_error_once_its_retries_are_spent(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=2, retry_backoff=FAST)
        inp = env.submit()
        (replica,) = env.start_ready()
        for _ in range(3):
            assert env.inputs_sent(replica) == [inp.id]
            raised(env, replica, inp)
            await asyncio.sleep(0.1)
        assert error_of(outcome_of(inp)) == ("ValueError", "boom")
        assert inp.attempts == 3
        assert "retrying in 0.04 s (retry 2 of 2)" in env.logs()

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("settings", "status", "error_type"),
    [
        ({"retries": 2}, 500, "ValueError"),  # a plain count: lost replicas only
        ({"retries": 2, "retry_backoff": FAST}, 400, "invalid_input"),  # the caller's fault
        ({"retries": 2, "retry_backoff": FAST}, 500, "result_too_large"),  # would recur
    ],
)
def test_what_is_not_retried(
    tmp_path: Path, settings: dict[str, object], status: int, error_type: str
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, **settings)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "error", inp, status=status, error_type=error_type, message="no")
        assert outcome_of(inp).status == status

    run(tmp_path, scenario)


def test_a_caller_leaving_during_the_backoff_ends_the_input(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=2, retry_backoff=FAST)
        inp = env.submit()
        (replica,) = env.start_ready()
        assert env.inputs_sent(replica) == [inp.id]
        raised(env, replica, inp)
        env.cluster.input_lifecycle.cancel(inp, "the caller disconnected")
        assert outcome_of(inp).status == 499
        await asyncio.sleep(0.05)
        assert env.inputs_sent(replica) == []  # not sent again
        assert not env.runtime.pending

    run(tmp_path, scenario)


def test_a_deadline_that_passes_during_the_backoff_says_so(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        slow = Retries(max_retries=2, initial_delay=5.0).backoff()
        env.deploy(max_replicas=1, retries=2, retry_backoff=slow)
        inp = env.submit()
        inp.timeout = 1.0
        (replica,) = env.start_ready()
        env.sent(replica)
        raised(env, replica, inp)
        env.cluster.input_lifecycle._deadline_passed(inp)  # as its timer would, mid-backoff
        error_type, message = error_of(outcome_of(inp))
        assert error_type == "deadline_exceeded"
        assert "waiting out its retry delay after its code raised" in message

    run(tmp_path, scenario)


def test_a_spawned_call_waiting_to_be_retried_is_stored_as_queued(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=1, retry_backoff=FAST)
        inp = env.submit(is_async=True)
        (replica,) = env.start_ready()
        raised(env, replica, inp)
        record = env.cluster.calls.get(inp.id)
        assert record is not None and record.status is CallStatus.QUEUED

    run(tmp_path, scenario)


def test_retries_settings_and_delays() -> None:
    policy = Retries(max_retries=4, initial_delay=1.0, backoff_coefficient=3.0, max_delay=5.0)
    assert [retry_delay(policy.backoff(), n) for n in (1, 2, 3)] == [1.0, 3.0, 5.0]
    with pytest.raises(InvalidError, match="use 0 to 10"):
        Retries(max_retries=11)
    with pytest.raises(InvalidError, match="backoff_coefficient"):
        Retries(max_retries=1, backoff_coefficient=0.5)
    with pytest.raises(InvalidError, match="not Retries' form"):
        EndpointSettings(retry_backoff={"initial_delay": 1.0})
