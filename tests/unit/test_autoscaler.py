"""The autoscaling policy, driven through scripted timelines with a fake clock."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from ember_platform.scaling.autoscaler import (
    Observation,
    ScalingSettings,
    desired_replicas,
    scale_down_key,
)

Idle = float | None


def settings(
    min_replicas: int = 0,
    max_replicas: int = 4,
    concurrency: int = 1,
    scaledown_window: float = 30.0,
) -> ScalingSettings:
    return ScalingSettings(min_replicas, max_replicas, concurrency, scaledown_window)


def decide(
    s: ScalingSettings, *, queued: int = 0, running: int = 0, idle: Sequence[Idle] = (), now: float
) -> int:
    return desired_replicas(Observation(queued, running, tuple(idle), now), s)


@dataclass(frozen=True)
class Step:
    t: float
    queued: int
    running: int
    idle: tuple[Idle, ...]  # one entry per live replica, as the controller reports it
    expect: int


def run_timeline(s: ScalingSettings, steps: Sequence[Step], start: int = 0) -> list[int]:
    """Feed each step through the policy the way a controller would.

    The controller applies each answer as the new replica count, so the replicas it
    reports on the next step must number exactly the previous answer; the script is
    checked for that too, which keeps the timelines honest.
    """
    count = start
    answers = []
    for step in steps:
        assert len(step.idle) == count, f"script error at t={step.t}: {count} replicas live"
        count = desired_replicas(Observation(step.queued, step.running, step.idle, step.t), s)
        answers.append(count)
    assert answers == [step.expect for step in steps]
    return answers


# --- scripted timelines --------------------------------------------------------------


def test_scale_from_zero_at_once_on_first_queued_input() -> None:
    s = settings(scaledown_window=30)
    run_timeline(
        s,
        [
            Step(0.0, 0, 0, (), 0),  # nothing to do: stay at zero
            Step(1.0, 0, 0, (), 0),
            Step(2.0, 1, 0, (), 1),  # the first input: one replica, on this tick
            Step(2.5, 1, 0, (None,), 1),  # starting: keep it
            Step(3.0, 0, 1, (None,), 1),  # running
        ],
    )


def test_scale_up_to_cover_demand_at_once() -> None:
    s = settings(max_replicas=10, concurrency=4)
    # 9 queued + 0 running at 4 per replica -> 3 replicas on the first tick.
    assert decide(s, queued=9, now=0.0) == 3
    # Demand counts running inputs as well as queued ones.
    assert decide(s, queued=3, running=10, idle=(None, None, None), now=1.0) == 4
    # Exactly divisible: no extra replica.
    assert decide(s, queued=8, now=0.0) == 2
    run_timeline(
        s,
        [
            Step(0.0, 1, 0, (), 1),
            Step(0.1, 5, 0, (None,), 2),  # ceil(5/4)
            Step(0.2, 17, 0, (None, None), 5),  # ceil(17/4), in one step
            Step(0.3, 0, 20, (None,) * 5, 5),
        ],
    )


@pytest.mark.parametrize("queued", [11, 100, 10**9])
def test_never_above_max_replicas(queued: int) -> None:
    s = settings(max_replicas=5, concurrency=2)
    assert decide(s, queued=queued, now=0.0) == 5
    assert decide(s, queued=queued, running=10, idle=(None,) * 5, now=1.0) == 5


def test_never_below_min_replicas() -> None:
    s = settings(min_replicas=2, max_replicas=6, scaledown_window=10)
    # With nothing deployed yet, the floor is met at once even with no traffic.
    assert decide(s, now=0.0) == 2
    run_timeline(
        s,
        [
            Step(0.0, 0, 0, (), 2),
            Step(1.0, 6, 0, (None, None), 6),
            Step(2.0, 0, 0, (2.0,) * 6, 6),
            Step(100.0, 0, 0, (2.0,) * 6, 2),  # everyone expired, the floor holds two
            Step(1000.0, 0, 0, (2.0, 2.0), 2),
        ],
        start=0,
    )


def test_no_scale_down_while_inputs_run() -> None:
    s = settings(max_replicas=4, concurrency=4, scaledown_window=0)
    # Two replicas each running one input: demand fits one replica, but both are busy
    # (idle_since None), so neither may go even with a zero window.
    assert decide(s, running=2, idle=(None, None), now=1_000.0) == 2
    run_timeline(
        s,
        [
            Step(0.0, 3, 0, (), 1),
            Step(10.0, 0, 3, (None,), 1),
            Step(10_000.0, 0, 1, (None,), 1),
        ],
    )


def test_scale_down_only_after_window_one_step_per_expired_replica() -> None:
    s = settings(max_replicas=4, scaledown_window=30)
    # Three replicas went idle at t=0, 5 and 10.
    idle3 = (0.0, 5.0, 10.0)
    run_timeline(
        s,
        [
            Step(0.0, 3, 0, (), 3),
            Step(1.0, 0, 0, idle3, 3),
            Step(29.999, 0, 0, idle3, 3),  # nobody idle for 30 s yet
            Step(30.0, 0, 0, idle3, 2),  # the first expires exactly at the window
            Step(34.0, 0, 0, (5.0, 10.0), 2),
            Step(35.0, 0, 0, (5.0, 10.0), 1),
            Step(39.0, 0, 0, (10.0,), 1),
            Step(40.0, 0, 0, (10.0,), 0),  # scale to zero
            Step(500.0, 0, 0, (), 0),
        ],
    )


def test_several_replicas_expiring_together_go_together() -> None:
    s = settings(max_replicas=8, scaledown_window=10)
    idle = (0.0, 0.0, 0.0, 7.0)
    assert decide(s, idle=idle, now=9.0) == 4
    assert decide(s, idle=idle, now=10.0) == 1  # three expired: three fewer
    assert decide(s, idle=idle, now=17.0) == 0


def test_scale_down_never_below_demand() -> None:
    s = settings(max_replicas=8, concurrency=2, scaledown_window=10)
    # Four replicas all long idle, but 3 inputs are queued: two replicas are needed.
    assert decide(s, queued=3, idle=(0.0,) * 4, now=100.0) == 2


def test_starting_replicas_are_never_removed() -> None:
    s = settings(max_replicas=4, scaledown_window=0)
    # The input that asked for them was taken elsewhere; they are still starting.
    assert decide(s, idle=(None, None, None), now=1e6) == 3
    # One expired replica next to two starting ones: only the expired one goes.
    assert decide(s, idle=(None, 0.0, None), now=1e6) == 2


def test_scale_to_zero_after_window() -> None:
    s = settings(min_replicas=0, scaledown_window=60)
    run_timeline(
        s,
        [
            Step(0.0, 1, 0, (), 1),
            Step(5.0, 0, 1, (None,), 1),
            Step(6.0, 0, 0, (6.0,), 1),
            Step(65.9, 0, 0, (6.0,), 1),
            Step(66.0, 0, 0, (6.0,), 0),
            Step(67.0, 1, 0, (), 1),  # and back up on the next input
        ],
    )


def test_zero_window_scales_down_immediately() -> None:
    s = settings(scaledown_window=0)
    assert decide(s, idle=(5.0,), now=5.0) == 0
    assert decide(s, idle=(5.0, 5.0, None), now=5.0) == 1


def test_count_above_max_drops_to_cap() -> None:
    # A redeploy lowered max_replicas from 6 to 2 while six replicas were busy.
    s = settings(max_replicas=2, scaledown_window=30)
    assert decide(s, running=6, idle=(None,) * 6, now=0.0) == 2
    assert decide(s, queued=50, idle=(None,) * 6, now=0.0) == 2
    # Idle but not expired: the cap still applies at once.
    assert decide(s, idle=(0.0,) * 6, now=1.0) == 2


def test_count_above_max_with_expired_replicas_drops_to_cap_and_min() -> None:
    s = settings(min_replicas=1, max_replicas=2, scaledown_window=30)
    # Five replicas, all long expired, max 2, min 1: only the floor remains.
    assert decide(s, idle=(0.0,) * 5, now=100.0) == 1


def test_count_above_max_keeps_non_expired_replicas() -> None:
    s = settings(min_replicas=0, max_replicas=2, scaledown_window=10)
    # Two replicas still starting, two long idle; the two expired ones are exactly the
    # surplus, so the two starting ones must stay.
    assert decide(s, idle=(None, None, 0.0, 0.0), now=100.0) == 2


# --- properties ------------------------------------------------------------------------


def _random_case(rng: random.Random) -> tuple[Observation, ScalingSettings]:
    min_r = rng.randint(0, 5)
    max_r = rng.randint(max(min_r, 1), 12)
    s = ScalingSettings(
        min_replicas=min_r,
        max_replicas=max_r,
        concurrency=rng.randint(1, 8),
        scaledown_window=rng.choice([0.0, 0.5, 10.0, 60.0, rng.uniform(0, 100)]),
    )
    now = rng.uniform(0, 200)
    idle = tuple(
        None if rng.random() < 0.3 else now - rng.uniform(0, 150) for _ in range(rng.randint(0, 16))
    )
    obs = Observation(
        queued=rng.choice([0, 0, rng.randint(0, 50), rng.randint(0, 10_000)]),
        running=rng.choice([0, rng.randint(0, 40)]),
        replica_idle_since=idle,
        now=now,
    )
    return obs, s


def _non_expired(obs: Observation, s: ScalingSettings) -> int:
    return sum(1 for i in obs.replica_idle_since if i is None or obs.now - i < s.scaledown_window)


def test_property_result_within_bounds_and_covers_demand() -> None:
    rng = random.Random(20240611)
    for _ in range(5000):
        obs, s = _random_case(rng)
        result = desired_replicas(obs, s)
        assert isinstance(result, int)
        assert s.min_replicas <= result <= s.max_replicas, (obs, s, result)
        needed = math.ceil((obs.queued + obs.running) / s.concurrency)
        assert result >= min(needed, s.max_replicas), (obs, s, result)


def test_property_never_removes_non_expired_replicas_within_cap() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(5000):
        obs, s = _random_case(rng)
        if len(obs.replica_idle_since) > s.max_replicas:
            continue  # covered by the cap tests above
        checked += 1
        result = desired_replicas(obs, s)
        assert result >= _non_expired(obs, s), (obs, s, result)
    assert checked > 1000


def test_property_scaling_down_only_by_expired_replicas() -> None:
    rng = random.Random(99)
    for _ in range(5000):
        obs, s = _random_case(rng)
        result = desired_replicas(obs, s)
        current = len(obs.replica_idle_since)
        expired = current - _non_expired(obs, s)
        if s.min_replicas <= current <= s.max_replicas:
            assert result >= current - expired, (obs, s, result)


def test_property_is_pure_and_deterministic() -> None:
    rng = random.Random(3)
    for _ in range(500):
        obs, s = _random_case(rng)
        assert desired_replicas(obs, s) == desired_replicas(obs, s)


def test_buffer_replicas_wait_ready_while_there_is_work() -> None:
    s = ScalingSettings(0, 6, 2, 30.0, buffer_replicas=2)
    assert decide(s, now=0.0) == 0  # no work: no buffer, scale to zero stays possible
    assert decide(s, queued=1, now=0.0) == 3  # one for the input, two ready beside it
    assert decide(s, queued=4, running=3, idle=(None,) * 3, now=1.0) == 6  # 4 + 2
    assert decide(s, queued=20, idle=(None,) * 6, now=2.0) == 6  # within max_replicas
    # The work is done: the buffer goes as its replicas' windows run out, not at once.
    idle = (10.0, 10.0, 10.0)
    assert decide(s, idle=idle, now=20.0) == 3
    assert decide(s, idle=idle, now=40.0) == 0


def test_scale_down_takes_the_expired_first_then_the_youngest() -> None:
    """Replicas as (name, idle_since, placed_at), at now=100 with a 30 s window."""
    replicas: list[tuple[str, float | None, float]] = [
        ("warm-old", 99.0, 10.0),  # adopted: it ran long before this process knew it
        ("expired-late", 65.0, 20.0),
        ("expired-early", 50.0, 90.0),
        ("just-placed", 99.5, 98.0),  # started while the old ones' worker reconnected
        ("placed-before", 99.5, 60.0),
        ("busy-young", None, 95.0),  # over the cap, busy or not: it finishes first
    ]
    ordered = sorted(replicas, key=lambda r: scale_down_key(r[1], r[2], 100.0, 30.0))
    assert [name for name, *_ in ordered] == [
        "expired-early",
        "expired-late",
        "just-placed",
        "busy-young",
        "placed-before",
        "warm-old",
    ]
