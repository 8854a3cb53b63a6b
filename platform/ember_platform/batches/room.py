"""How many more of a batch's requests an endpoint takes now, pure: batches use capacity
that online calls leave idle, so that they never make an online call wait."""

from __future__ import annotations


def batch_room(
    ready_replicas: int, free_slots: int, online_waiting: int, batch_waiting: int
) -> int:
    """Requests to submit now. `free_slots`: inputs the ready replicas could take beside
    what they run; `online_waiting`, `batch_waiting`: queued inputs of each kind. With no
    replica ready, one request, unless one waits already: a queued input is what makes
    the autoscaler start a replica of an endpoint scaled to zero."""
    if ready_replicas == 0:
        return 0 if batch_waiting or online_waiting else 1
    return max(0, free_slots - online_waiting - batch_waiting)
