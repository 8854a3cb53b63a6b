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


@dataclass(frozen=True)
class Observation:
    queued: int  # inputs waiting for a replica
    running: int  # inputs being run by a replica
    # One entry per live replica (starting or ready, not draining): the time it last
    # became idle, or None while it is starting or running inputs.
    replica_idle_since: tuple[float | None, ...]
    now: float


def desired_replicas(observation: Observation, settings: ScalingSettings) -> int:
    """How many replicas the endpoint should have now.

    Scale up at once to cover every queued and running input at `concurrency` inputs per
    replica, plus `buffer_replicas` while there is any (so a burst finds replicas ready
    instead of waiting for starts); scale down only by replicas that have been idle for
    `scaledown_window`; stay within [min_replicas, max_replicas].
    """
    demand = observation.queued + observation.running
    needed = math.ceil(demand / settings.concurrency)
    if demand:
        needed += settings.buffer_replicas
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
