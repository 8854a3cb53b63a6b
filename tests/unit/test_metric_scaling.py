"""Scaling on an engine metric (`scale_on=ember.MetricTarget`): the pure policy, then the
controller on a control plane without a network, fed by replicas' EngineMetrics."""

from __future__ import annotations

import time
from pathlib import Path

from cluster_harness import Env, run

from ember.declarations.engine_metrics import MetricTarget
from ember.wire import messages as wire
from ember_platform.observability.engine_metrics import STALE_SECONDS
from ember_platform.runtime.cluster_model import Replica
from ember_platform.scaling.autoscaler import Observation, ScalingSettings, desired_replicas

WAITING = "vllm:num_requests_waiting"


def settings(per_replica: float | None = 4.0, *, max_replicas: int = 8) -> ScalingSettings:
    return ScalingSettings(0, max_replicas, 1, 30.0, 0, per_replica)


def decide(
    s: ScalingSettings,
    total: float | None,
    *,
    queued: int = 0,
    running: int = 0,
    idle: tuple[float | None, ...] = (),
    now: float = 100.0,
) -> int:
    return desired_replicas(Observation(queued, running, idle, now, total), s)


def test_the_metric_s_sum_over_the_target_sizes_the_endpoint() -> None:
    s = settings(4.0)
    assert decide(s, 8.0, idle=(None,)) == 2
    assert decide(s, 9.0, idle=(None,)) == 3
    assert decide(s, 8.000000000001, idle=(None, None)) == 2  # float sums: no extra replica
    assert decide(s, 0.5, idle=(None,)) == 1
    assert decide(settings(0.7), 2.1, idle=(None, None)) == 3  # a fraction (KV-cache use)


def test_the_larger_of_queue_depth_and_the_metric_wins() -> None:
    s = settings(4.0)
    assert decide(s, 4.0, queued=3, running=2, idle=(None,)) == 5  # the queue asks more
    assert decide(s, 20.0, running=1, idle=(None,)) == 5  # the engine's queue asks more


def test_without_a_value_or_a_target_queue_depth_decides_alone() -> None:
    assert decide(settings(4.0), None, running=1, idle=(None,)) == 1
    assert decide(settings(None), 100.0, running=1, idle=(None,)) == 1
    assert decide(settings(4.0), 0.0, idle=(50.0,), now=100.0) == 0  # idle past the window
    assert decide(settings(4.0), -3.0, idle=(None,)) == 1  # a negative gauge asks for nothing


def test_max_min_and_the_scaledown_window_still_hold() -> None:
    s = ScalingSettings(1, 3, 1, 30.0, 0, 1.0)
    assert decide(s, 50.0, idle=(None,)) == 3
    assert decide(s, float("inf"), idle=(None,)) == 3
    assert decide(s, 0.0, idle=()) == 1
    # The metric fell: only replicas idle for the window go, one at a time as they expire.
    assert decide(s, 1.0, idle=(None, 90.0, 60.0), now=100.0) == 2
    assert decide(s, 1.0, idle=(None, 90.0, 80.0), now=100.0) == 3


def scrape(env: Env, replica: Replica, value: float | None) -> None:
    samples = [] if value is None else [wire.EngineSample(WAITING, {"model_name": "m"}, value)]
    families = [wire.EngineFamily(WAITING, "gauge", samples)] if samples else []
    body = wire.engine_body(families)
    env.cluster.messages.from_replica(replica, wire.frame(wire.EngineMetrics(), body))


def test_the_controller_scales_on_what_replicas_scrape(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        target = MetricTarget(WAITING, per_replica=2.0)
        env.deploy(
            max_replicas=4,
            scaledown_window=60.0,
            engine_metrics="prometheus",
            scale_on=target.to_dict(),
        )
        env.submit()
        (first,) = env.start_ready()
        scrape(env, first, 5.0)  # its engine holds 5 waiting: 3 replicas at 2 each
        env.tick()
        second, third = env.started(env.commands())
        for replica in (second, third):
            env.ready(replica)
        scrape(env, second, 0.0)
        env.tick()
        assert env.commands() == []
        # A replica of an endpoint that names no engine metrics sends none that count.
        env.deploy(version=2, max_replicas=4)
        assert env.cluster.engine_metrics.value(first.id, WAITING) == 5.0
        scrape(env, first, 50.0)
        assert env.cluster.engine_metrics.value(first.id, WAITING) == 5.0

    run(tmp_path, scenario)


def test_without_fresh_values_queue_depth_decides_and_the_log_says_so_once(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(
            max_replicas=4,
            engine_metrics="http://127.0.0.1:8000/metrics",
            scale_on=MetricTarget(WAITING, per_replica=1.0).to_dict(),
        )
        env.submit()
        (replica,) = env.start_ready()
        scrape(env, replica, 3.0)
        env.tick()
        assert len(env.started(env.commands())) == 2
        clock = env.cluster.engine_metrics.clock
        later = time.time() + STALE_SECONDS + 1
        env.cluster.engine_metrics.clock = lambda: later  # its scrape is stale now
        assert replica.ready_at is not None
        replica.ready_at -= STALE_SECONDS + 1
        for _ in range(3):
            env.tick()
        said = "scaling on queue depth alone: no replica has sent a fresh value"
        assert env.logs().count(said) == 1
        env.cluster.engine_metrics.clock = clock
        scrape(env, replica, 3.0)  # fresh again
        env.tick()
        env.cluster.engine_metrics.clock = lambda: later
        env.tick()
        assert env.logs().count(said) == 2  # once more: it had values in between

    run(tmp_path, scenario)
