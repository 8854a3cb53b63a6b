"""How many more of a batch's requests an endpoint takes now, pure: batches use capacity
that online calls leave idle, and leave room for as many online calls as the endpoint
held at once lately, so that an online call arriving finds a slot free."""

from __future__ import annotations

from collections import deque

PEAK_WINDOW_SECONDS = 60.0


def batch_room(
    slots: int, free_slots: int, online_waiting: int, batch_waiting: int, online_peak: int
) -> int:
    """Requests to submit now. `slots`: the ready replicas' in all; `free_slots`: those
    not taken; `online_waiting`, `batch_waiting`: queued inputs of each kind;
    `online_peak`: the most online inputs held at once lately. One slot more than that
    peak is kept free for online calls to come, but never every slot: an endpoint of one
    slot runs a batch's requests when no online call waits. With no replica ready, one
    request, unless one waits already: a queued input is what makes the autoscaler start
    a replica of an endpoint scaled to zero."""
    if slots == 0:
        return 0 if batch_waiting or online_waiting else 1
    headroom = min(online_peak + 1, slots - 1)
    return max(0, free_slots - online_waiting - batch_waiting - headroom)


class OnlinePeak:
    """The most online inputs an endpoint held at once (queued or running) over the last
    `window` seconds, from counts noted with the time they were seen."""

    def __init__(self, window: float = PEAK_WINDOW_SECONDS) -> None:
        self.window = window
        self._counts: deque[tuple[float, int]] = deque()  # decreasing counts, by time

    def note(self, now: float, count: int) -> None:
        while self._counts and self._counts[-1][1] <= count:
            self._counts.pop()  # never the peak again while this one is in the window
        self._counts.append((now, count))

    def peak(self, now: float) -> int:
        while self._counts and self._counts[0][0] < now - self.window:
            self._counts.popleft()
        return self._counts[0][1] if self._counts else 0
