"""The autoscaling policy: a pure function from what is observed to a replica count.

No clock is read here; `now` comes in with the observation, so timelines can be scripted
in tests and the controller can call this on a short tick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingSettings:
    min_replicas: int
    max_replicas: int
    concurrency: int  # inputs per replica to size for (the endpoint's target)
    scaledown_window: float
    buffer_replicas: int = 0  # idle replicas kept ready beyond demand while there is work
    # An engine metric's target per replica (`scale_on=ember.MetricTarget`), if any.
    metric_per_replica: float | None = None


@dataclass(frozen=True)
class Observation:
    queued: int  # inputs waiting for a replica
    running: int  # inputs being run by a replica
    # One entry per live replica (starting or ready, not draining): the time it last
    # became idle, or None while it is starting or running inputs.
    replica_idle_since: tuple[float | None, ...]
    now: float
    # The engine metric's sum over the replicas that have a fresh value of it; None when
    # none has (queue depth alone decides then).
    metric_total: float | None = None


def desired_replicas(observation: Observation, settings: ScalingSettings) -> int:
    """How many replicas the endpoint should have now.

    Scale up at once to cover every queued and running input at `concurrency` inputs per
    replica, plus `buffer_replicas` while there is any (so a burst finds replicas ready
    instead of waiting for starts); scale down only by replicas that have been idle for
    `scaledown_window`; stay within [min_replicas, max_replicas]. With an engine metric's
    target, the count is at least what keeps the metric's sum per replica at the target
    (the larger of the two: queue depth and the engine's own measure of its load).
    """
    demand = observation.queued + observation.running
    needed = math.ceil(demand / settings.concurrency)
    if demand:
        needed += settings.buffer_replicas
    per_replica, total = settings.metric_per_replica, observation.metric_total
    if per_replica is not None and total is not None and total > 0:
        ratio = min(total / per_replica, float(settings.max_replicas))  # inf: the cap
        # A hair above a whole multiple (float sums) is that multiple, not one more.
        needed = max(needed, math.ceil(ratio - 1e-9))
    target = max(settings.min_replicas, min(settings.max_replicas, needed))
    current = len(observation.replica_idle_since)
    if target >= current:
        return target
    expired = sum(
        1
        for idle_since in observation.replica_idle_since
        if idle_since is not None and observation.now - idle_since >= settings.scaledown_window
    )
    # A count above max_replicas (lowered by a redeploy) drops to the cap at once.
    return max(target, min(current - expired, settings.max_replicas))


def scale_down_key(
    idle_since: float | None, placed_at: float, now: float, window: float
) -> tuple[int, float]:
    """Which replicas go first when there are more than `desired_replicas` wants: those
    idle for the scale-down window (`idle_since`: None while starting or busy), longest
    idle first. Only over the cap are there more to go (`max_replicas` lowered, or a
    control plane that took over adopting replicas beside ones it had just started):
    then the most recently placed go first, busy or not, so that the ones that have run
    longest, warm, stay."""
    if idle_since is not None and now - idle_since >= window:
        return (0, idle_since)
    return (1, -placed_at)
