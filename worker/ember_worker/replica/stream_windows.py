"""Flow control of a streaming input: the replica makes events at most a window ahead of
what the control plane has taken for the caller, so a slow reader holds the generator
back instead of piling its output up in the control plane's memory."""

from __future__ import annotations

import asyncio

from ember.wire.limits import STREAM_WINDOW_BYTES


class StreamWindow:
    """Bytes of one input's events sent on the channel, and how many of them the control
    plane has acknowledged (`ack` frames)."""

    def __init__(self, size: int = STREAM_WINDOW_BYTES) -> None:
        self.size = size
        self.sent = 0
        self.acked = 0
        self._moved = asyncio.Event()

    @property
    def outstanding(self) -> int:
        return self.sent - self.acked

    async def after_send(self, nbytes: int) -> None:
        """Count an event just sent; wait while more than a window is unacknowledged. The
        event that crosses the line still goes: one larger than the window is not stuck."""
        self.sent += nbytes
        while self.outstanding > self.size:
            self._moved.clear()
            await self._moved.wait()

    def acknowledged(self, total: int) -> None:
        """The control plane has taken `total` bytes of this input's events so far."""
        if total > self.acked:
            self.acked = total
            self._moved.set()

    def release(self) -> None:
        """The channel it counted on closed: nobody will acknowledge what was sent, so
        the stream no longer waits (its events go to a control plane that may drop them)."""
        self.size = 2**62
        self._moved.set()
