"""How much of a replica's output the node ships to its log: a token bucket of bytes (a
rate, and a burst the replica may print at once), and what was dropped past it, for
the marker line that says so. Pure: the clock is passed in."""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
DEFAULT_RATE_KIB = 1024  # a second, per replica (`ember worker --log-rate`)
DEFAULT_BURST_KIB = 10 * 1024  # (`ember worker --log-burst`)
# A replica dropping lines gets one marker a second at most, and one when it ends.
MARKER_SECONDS = 1.0


@dataclass(frozen=True)
class LogLimit:
    """Bytes a second of output, and bytes at once beyond that rate."""

    rate_kib: int = DEFAULT_RATE_KIB
    burst_kib: int = DEFAULT_BURST_KIB

    def within(self, node: LogLimit) -> LogLimit:
        """This limit (an endpoint's) capped at the node's: a burst of ten seconds of its
        rate, as the node's is by default."""
        rate = min(self.rate_kib, node.rate_kib)
        return LogLimit(rate, min(node.burst_kib, rate * 10))

    def __str__(self) -> str:
        return f"{self.rate_kib} KiB/s (bursts of {self.burst_kib} KiB)"


@dataclass
class Dropped:
    """Output dropped since the last marker."""

    lines: int = 0
    size: int = 0  # bytes
    unsent: int = 0  # of the lines, those past the node's buffer rather than the limit


class LogBudget:
    """One replica's allowance, shared by its stdout and stderr."""

    def __init__(self, limit: LogLimit, now: float) -> None:
        self.limit = limit
        self._rate = float(limit.rate_kib * KIB)
        self._burst = float(limit.burst_kib * KIB)
        self._tokens = self._burst
        self._updated = now
        self.dropped = Dropped()
        self._marked = now  # when the last marker was due

    def take(self, size: int, now: float) -> bool:
        """Whether `size` bytes more may be shipped now (they are counted if so)."""
        elapsed = max(0.0, now - self._updated)
        self._updated = now
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        if size > self._tokens:
            return False
        self._tokens -= size
        return True

    def drop(self, lines: int, size: int, unsent: bool = False) -> None:
        self.dropped.lines += lines
        self.dropped.size += size
        if unsent:
            self.dropped.unsent += lines

    def marker_due(self, now: float, ending: bool = False) -> Dropped | None:
        """What was dropped since the last marker, when one is due (a second after the
        last, or as the output ends), and the count starts again; else None."""
        if not self.dropped.lines or (not ending and now - self._marked < MARKER_SECONDS):
            return None
        dropped, self.dropped = self.dropped, Dropped()
        self._marked = now
        return dropped


def marker_text(dropped: Dropped, limit: LogLimit) -> str:
    """The line in the replica's log that says what of its output was dropped."""
    mib = dropped.size / (KIB * KIB)
    lines = "line" if dropped.lines == 1 else "lines"
    why = f"it printed past its log limit of {limit}"
    if dropped.unsent == dropped.lines:
        why = "the node's log buffer was full (its lines reach the control plane slower)"
    elif dropped.unsent:
        why += f"; {dropped.unsent} of them as the node's log buffer was full"
    return f"ember: {dropped.lines} {lines} ({mib:.1f} MiB) of this replica's output dropped: {why}"
