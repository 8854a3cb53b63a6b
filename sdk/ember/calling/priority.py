"""Call priorities: `X-Ember-Priority: high | normal | low` (`call(_priority="high")`).

An endpoint's queue is served highest priority first, in arrival order within one, so
that interactive calls sharing an endpoint with batch work do not wait behind it. A call
already running is never stopped for a higher one; one retried after its replica was
lost goes back to the front."""

from __future__ import annotations

from ember.cancellation import current_input_flag
from ember.errors import InvalidError

PRIORITY_HEADER = "X-Ember-Priority"
PRIORITIES = ("high", "normal", "low")  # served in this order
NORMAL = PRIORITIES.index("normal")


def priority_rank(name: str) -> int:
    """0 for high, 1 for normal, 2 for low; InvalidError naming the choices otherwise."""
    try:
        return PRIORITIES.index(name.strip().lower())
    except ValueError:
        raise InvalidError(f"priority {name!r} is not one of {', '.join(PRIORITIES)}") from None


def priority_headers(priority: str | None) -> dict[str, str]:
    """The header that asks for `priority` (checked here, before any request is sent)."""
    if priority is None:
        return {}
    priority_rank(priority)
    return {PRIORITY_HEADER: priority}


def current_priority() -> str | None:
    """In a replica, the priority of the call this code runs for ("high", "normal", or
    "low": a Batch API request's), for an engine that schedules by it; None outside a
    call."""
    flag = current_input_flag()
    rank = getattr(flag, "priority", None)
    return None if rank is None else PRIORITIES[rank]
