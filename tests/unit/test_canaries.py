"""Canary deploys in the control plane: the share of calls a canary gets, its own queue
and replicas, promotion (its replicas join the serving runtime, the old version's
retire) and withdrawal (its queue goes to the serving version, its replicas drain)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_harness import LABEL, Env, deployment, outcome_of, run

from ember.errors import InvalidError
from ember_platform.core.canaries import check_canary_percent, route
from ember_platform.core.cluster_status import endpoint_rows
from ember_platform.runtime.cluster_model import ReplicaState, VersionOutcomes


def canary_deployment(version: int = 2, percent: int = 20, **settings: object):  # type: ignore[no-untyped-def]
    d = deployment(version, **settings)
    d.canary_percent = percent
    return d


def test_a_canary_gets_its_share_of_calls_and_a_key_always_the_same_version(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        serving = env.runtime
        assert route(env.cluster.canaries, serving, None) is serving  # no canary
        (canary,) = env.cluster.trials.apply(canary_deployment(percent=25))
        picks = [route(env.cluster.canaries, serving, None) for _ in range(4000)]
        assert 0.21 < picks.count(canary) / len(picks) < 0.29
        keyed = {f"user-{n}": route(env.cluster.canaries, serving, f"user-{n}") for n in range(400)}
        assert all(route(env.cluster.canaries, serving, k) is v for k, v in keyed.items())
        assert 0.15 < list(keyed.values()).count(canary) / 400 < 0.35
        env.cluster.trials.set_percent("demo", 99)
        assert all(route(env.cluster.canaries, serving, f"user-{n}") is canary for n in range(90))

    run(tmp_path, scenario)


@pytest.mark.parametrize("value", [0, 100, 12.5, True, "10", None])
def test_the_share_is_1_to_99_percent(value: object) -> None:
    with pytest.raises(InvalidError, match="1 to 99 percent"):
        check_canary_percent(value)


def test_a_canary_scales_on_its_own_queue_with_its_own_version(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=2)
        (canary,) = env.cluster.trials.apply(canary_deployment(max_replicas=2))
        inp = env.submit(canary=True)
        assert list(canary.pending) == [inp] and not env.runtime.pending
        (replica,) = env.start_ready()
        assert replica.endpoint is canary and replica.version == 2
        assert inp.replica_id == replica.id
        env.reply(replica, "result", inp, b"7")
        assert outcome_of(inp).body == b"7"
        row = endpoint_rows(env.cluster)[0]
        assert row["version"] == 1 and row["replicas"] == {}
        assert row["canary"]["version"] == 2 and row["canary"]["replicas"] == {"ready": 1}

    run(tmp_path, scenario)


def test_promotion_hands_the_canarys_replicas_and_queue_to_the_serving_runtime(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, concurrency=1)
        first = env.submit()
        (old,) = env.start_ready()
        (canary,) = env.cluster.trials.apply(canary_deployment(max_replicas=1, concurrency=1))
        busy = env.submit(canary=True)
        (new,) = env.start_ready()
        waiting = env.submit(canary=True)  # its replica is busy: it queues in the canary
        assert list(canary.pending) == [waiting]
        serving = env.cluster.trials.promote(LABEL)
        assert serving is env.runtime and serving.version == 2
        assert LABEL not in env.cluster.canaries
        assert new.endpoint is serving and new.id in serving.replicas
        assert list(serving.pending) == [waiting]
        env.reply(new, "result", busy, b"1")  # its slot frees: the moved input runs there
        assert waiting.replica_id == new.id
        env.reply(old, "result", first, b"0")
        env.tick()  # version 1's replica is idle and version 2 has one ready: it goes
        assert old.state is ReplicaState.STOPPING
        assert "canary promoted: version 2 serves every call" in env.logs()

    run(tmp_path, scenario)


def test_withdrawal_sends_the_canarys_queue_to_the_serving_version(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, concurrency=1)
        env.cluster.trials.apply(canary_deployment(max_replicas=1, concurrency=1))
        running = env.submit(canary=True)
        (replica,) = env.start_ready()
        queued = env.submit(canary=True)
        env.cluster.trials.withdraw(LABEL, "aborted")
        assert list(env.runtime.pending) == [queued] and not queued.canary
        assert replica.state is ReplicaState.DRAINING
        env.reply(replica, "result", running, b"1")  # what it ran finishes, then it stops
        assert outcome_of(running).body == b"1" and replica.state is ReplicaState.STOPPING
        (serving_replica,) = env.start_ready()
        assert serving_replica.version == 1 and queued.replica_id == serving_replica.id
        assert "canary version 2 withdrawn: aborted" in env.logs()

    run(tmp_path, scenario)


def test_a_new_serving_deploy_withdraws_the_canary(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.cluster.trials.apply(canary_deployment())
        queued = env.submit(canary=True)
        env.deploy(3)
        assert LABEL not in env.cluster.canaries
        assert list(env.runtime.pending) == [queued] and env.runtime.version == 3
        assert "canary version 2 withdrawn: version 3 was deployed" in env.logs()

    run(tmp_path, scenario)


def test_outcomes_count_calls_errors_and_latency() -> None:
    outcomes = VersionOutcomes()
    assert outcomes.summary()["error_rate"] is None
    for status, seconds in [(200, 0.1), (200, 0.3), (500, 0.2), (400, 0.05)]:
        outcomes.note(status, seconds)
    summary = outcomes.summary()
    assert (summary["calls"], summary["errors"], summary["error_rate"]) == (4, 1, 0.25)
    assert summary["p50_s"] == pytest.approx(0.15)
    assert json.dumps(summary)  # for the API as it is
