"""TLS handshakes in turn: a few at once, the connections waiting for theirs taken by
client address in rotation.

A handshake costs the event loop about half a millisecond of CPU, the cost of several
calls. A client that opens a thousand connections at once would otherwise queue a
thousand handshakes ahead of every request on connections already open (another
tenant's calls waited 0.4 s); through the gate, at most a few run between two of those
requests, and a new client waits behind one connection of each other address, not
behind all of them. A connection waiting for its turn has nothing read from it.
"""

from __future__ import annotations

import asyncio
from collections import deque

HANDSHAKES_AT_ONCE = 8  # a handshake waits on its client's answers too: several overlap


class HandshakeGate:
    def __init__(self, at_once: int = HANDSHAKES_AT_ONCE) -> None:
        self.at_once = at_once
        self.running = 0
        self._waiting: dict[str | None, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str | None] = deque()  # addresses with connections waiting

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    async def turn(self, address: str | None) -> None:
        """Wait until this connection may shake hands (then call `done()` once it has,
        however it ended). Cancelled: it left the queue."""
        if self.running < self.at_once and not self._turns:
            self.running += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        queue = self._waiting.get(address)
        if queue is None:
            queue = self._waiting[address] = deque()
            self._turns.append(address)
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.done()  # its turn came as it was cancelled: pass it on
            raise

    def done(self) -> None:
        """A handshake ended: the next connection in turn may start its own."""
        self.running -= 1
        while self._turns and self.running < self.at_once:
            address = self._turns.popleft()
            queue = self._waiting[address]
            waiter = queue.popleft()
            if queue:
                self._turns.append(address)  # its next connection, after the others'
            else:
                del self._waiting[address]
            if not waiter.done():  # one cancelled meanwhile passes its turn on
                waiter.set_result(None)
                self.running += 1
