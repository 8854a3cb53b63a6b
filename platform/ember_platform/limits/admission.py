"""Admission per workspace: whether a workspace may start one more call.

Every workspace shares the control plane's queues, event loop and memory; a tenant that
floods them slows the others. So each workspace has three limits (the server's defaults,
or an admin's `ember workspace set`): inputs waiting in its endpoints' queues, calls on
replicas at once, and calls accepted per second (a token bucket, as a token's rate
limit). A call past one is refused before it is queued, with the seconds to wait; one
admitted is never dropped later for these limits.

Pure: the caller counts the load, and the clock is passed in."""

from __future__ import annotations

from dataclasses import dataclass

from ember_platform.security.rate_limits import RateLimit, RateLimiter

# A queue or the replicas full: no telling when room comes, so soon, like QueueFull's.
BUSY_RETRY_S = 1.0


@dataclass(frozen=True)
class WorkspaceLimits:
    max_queued: int  # inputs waiting for a replica, over all its endpoints
    max_running: int  # calls dispatched to replicas and not finished
    rate: RateLimit | None = None  # calls accepted; None: no limit


@dataclass(frozen=True)
class Refusal:
    limit: str  # the setting passed: "max_queued", "max_running" or "rate"
    message: str  # for the caller: names the workspace and the limit
    retry_after: float  # seconds


def load_needed(limits: WorkspaceLimits, live_inputs: int) -> bool:
    """Whether the workspace's load must be counted: `live_inputs`, every workspace's
    inputs queued or running, bounds it, so below both limits no count is needed (the
    usual case, which keeps the check off the hot path's cost)."""
    return live_inputs >= min(limits.max_queued, limits.max_running)


class Admission:
    """The workspaces' rate buckets, and the decision for one call."""

    def __init__(self) -> None:
        self._buckets = RateLimiter()

    def admit(
        self, workspace: str, limits: WorkspaceLimits, queued: int, running: int, now: float
    ) -> Refusal | None:
        """None when the call may go (then it is counted in the workspace's rate);
        else why not. The rate is taken last: a call refused for another limit
        does not spend it."""
        if queued >= limits.max_queued:
            return Refusal(
                "max_queued",
                f"workspace {workspace} has {queued} inputs queued, its limit (max_queued); "
                "retry later",
                BUSY_RETRY_S,
            )
        if running >= limits.max_running:
            return Refusal(
                "max_running",
                f"workspace {workspace} has {running} calls running, its limit (max_running); "
                "retry later",
                BUSY_RETRY_S,
            )
        if limits.rate is None:
            return None
        wait = self._buckets.wait_needed(workspace, limits.rate, now)
        if not wait:
            return None
        return Refusal(
            "rate",
            f"workspace {workspace} may start {limits.rate} calls, its limit (rate); "
            f"retry in {wait:.2f} s",
            wait,
        )

    def forget(self, workspace: str) -> None:
        """A workspace removed: its bucket goes (one made later starts full)."""
        self._buckets.forget(workspace)
