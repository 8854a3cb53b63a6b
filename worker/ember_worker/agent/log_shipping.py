"""Lines for the control plane's logs: what replicas print, the agent's notes into a
replica's log, and the node's lines into an endpoint's log. Buffered here and sent in
batches every tenth of a second, each small enough for one channel message.

Nothing here grows with what a replica prints: its output is read in blocks, shipped
within its log limit (log_limits.py) and dropped past it or past the node's buffer,
with a marker line that says how much. Output past the limit is read no faster than
DROPPING_READ_RATE: a replica printing faster waits in its writes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from ember.wire import messages as wire
from ember.wire.labels import split_label
from ember.wire.limits import MAX_LOG_BATCH_BYTES
from ember_worker.agent.running_replica import STDERR_TAIL_LINES, RunningReplica
from ember_worker.log_limits import LogBudget, LogLimit, marker_text
from ember_worker.processes.replica_processes import open_reader
from ember_worker.replica.call_tagged_output import split_tag

log = logging.getLogger("ember.worker")

LOG_FLUSH_SECONDS = 0.1
READ_BLOCK = 64 * 1024  # of a replica's output at a time
# A line longer than this is cut here: the rest of it comes as lines of its own.
MAX_LINE_BYTES = 64 * 1024
# Text of the lines not yet sent, from every replica of the node: past it, a replica's
# lines are dropped (the channel takes them slower than they come).
MAX_BUFFERED_BYTES = 16 * 1024 * 1024
ENTRY_BYTES = 200  # an entry's fields besides its text, roughly
# What a line costs of its replica's log limit at least: each is an entry parsed, written
# and followed in the control plane, so short or empty lines are not nearly free.
MIN_LINE_COST = 64
# How fast the node reads a replica's output while it drops it (past its log limit):
# reading to drop costs the node's CPU, and the faster it reads, the faster the replica
# prints. Past this, the replica waits in its writes, as on any full pipe.
DROPPING_READ_RATE = 8 * 1024 * 1024  # bytes a second
NODE_DEFAULT = LogLimit()

Note = Callable[[RunningReplica, str], None]  # a line from the agent into a replica's log
EndpointNote = Callable[[str, str], None]  # a line of the node's into an endpoint's (label)
SendText = Callable[[str], Awaitable[None]]  # a message onto the channel, as it is


def log_batches(entries: list[dict[str, Any]], max_bytes: int) -> Iterator[list[dict[str, Any]]]:
    """The entries in order, cut into batches of about `max_bytes` of text at most, so
    that a replica printing fast never makes one channel message too large."""
    batch: list[dict[str, Any]] = []
    size = 0
    for entry in entries:
        entry_size = len(entry["text"]) + ENTRY_BYTES
        if batch and size + entry_size > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry_size
    if batch:
        yield batch


class _Output:
    """A replica's output as it is shipped: its budget, and its pipes still open."""

    def __init__(self, replica: RunningReplica, budget: LogBudget) -> None:
        self.replica = replica
        self.budget = budget
        self.open_pipes = 0


class LogShipper:
    def __init__(
        self, node_limit: LogLimit = NODE_DEFAULT, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.node_limit = node_limit  # every replica's, and the most an endpoint may set
        self.clock = clock
        self.buffer: list[dict[str, Any]] = []  # what the next flush sends
        self.buffered_bytes = 0
        self._outputs: dict[str, _Output] = {}  # by replica id, while its pipes are open

    def note(self, replica: RunningReplica, text: str) -> None:
        """A line from the agent into the replica's own log."""
        log.info("replica %s: %s", replica.replica_id, text)
        self._append(self._entry(replica, "ember", text), always=True)

    def endpoint_note(self, label: str, text: str) -> None:
        """A line of this node's into its log and into the endpoint's, beside the
        platform's lines."""
        log.info("%s", text)
        parts = split_label(label)
        if parts is not None:
            app, endpoint = parts
            entry = {"ts": time.time(), "app": app, "endpoint": endpoint, "stream": "ember"}
            self._append({**entry, "text": text}, always=True)

    async def ship_output(self, replica: RunningReplica, fd: int, name: str) -> None:
        """The lines of the replica's `name` pipe (stdout, stderr), until it closes."""
        output = self._output(replica)
        output.open_pipes += 1
        pipe = await open_reader(os.dup(fd))
        try:
            await self._read_lines(output, pipe.reader, name)
        finally:
            pipe.close()
            output.open_pipes -= 1
            if not output.open_pipes:
                self._outputs.pop(replica.replica_id, None)
                self._mark_dropped(output, ending=True)

    def _output(self, replica: RunningReplica) -> _Output:
        output = self._outputs.get(replica.replica_id)
        if output is None:
            limit = (replica.log_limit or self.node_limit).within(self.node_limit)
            output = _Output(replica, LogBudget(limit, self.clock()))
            self._outputs[replica.replica_id] = output
        return output

    async def _read_lines(self, output: _Output, stream: asyncio.StreamReader, name: str) -> None:
        partial = b""
        while True:
            block = await stream.read(READ_BLOCK)
            if not block:
                if partial:
                    self._lines(output, name, [partial])
                return
            lines = (partial + block).split(b"\n")
            partial = lines.pop()  # what follows the last newline: more may come
            if len(partial) > MAX_LINE_BYTES:
                lines.append(partial)
                partial = b""
            if self._lines(output, name, lines):
                await asyncio.sleep(len(block) / DROPPING_READ_RATE)

    def _lines(self, output: _Output, name: str, lines: list[bytes]) -> bool:
        """Ship what the budget allows of `lines`, in order; drop the rest, counted.
        Whether any was dropped for the limit."""
        budget, replica, now = output.budget, output.replica, self.clock()
        for at, raw in enumerate(lines):
            if not budget.take(max(len(raw) + 1, MIN_LINE_COST), now):
                rest = lines[at:]
                budget.drop(len(rest), sum(len(line) + 1 for line in rest))
                if name == "stderr":  # why it may end is in its last words
                    for line in rest[-STDERR_TAIL_LINES:]:
                        text = split_tag(line.decode(errors="replace"))[1]
                        replica.stderr_tail.append((now, text))
                self._mark_dropped(output)
                return True
            call, text = split_tag(raw.decode(errors="replace"))
            if name == "stderr":
                replica.stderr_tail.append((now, text))
            entry = self._entry(replica, name, text)
            if call is not None:
                entry["call"] = call
            if not self._append(entry):
                budget.drop(1, len(raw) + 1, unsent=True)
        self._mark_dropped(output)
        return False

    def _mark_dropped(self, output: _Output, ending: bool = False) -> None:
        """The marker line of what the replica's output lost, when one is due."""
        dropped = output.budget.marker_due(self.clock(), ending)
        if dropped is not None:
            entry = self._entry(output.replica, "ember", marker_text(dropped, output.budget.limit))
            entry["dropped"] = dropped.lines
            self._append(entry, always=True)

    def _entry(self, replica: RunningReplica, stream: str, text: str) -> dict[str, Any]:
        return {
            "ts": time.time(),
            "app": replica.app,
            "endpoint": replica.endpoint,
            "replica": replica.replica_id,
            "stream": stream,
            "text": text,
        }

    def _append(self, entry: dict[str, Any], always: bool = False) -> bool:
        """Buffer a line for the next flush, unless the buffer is full (False). The
        platform's own lines (`always`) go in whatever replicas printed."""
        size = len(entry["text"]) + ENTRY_BYTES
        if not always and self.buffered_bytes + size > MAX_BUFFERED_BYTES:
            return False
        self.buffer.append(entry)
        self.buffered_bytes += size
        return True

    async def flush_to(self, send: SendText) -> None:
        """Send what is buffered, every LOG_FLUSH_SECONDS, for as long as the channel's
        session lasts (it cancels this); and the markers of replicas whose output has
        been dropped and that print no more."""
        while True:
            await asyncio.sleep(LOG_FLUSH_SECONDS)
            for output in list(self._outputs.values()):
                self._mark_dropped(output)
            if self.buffer:
                entries, self.buffer, self.buffered_bytes = self.buffer, [], 0
                for batch in log_batches(entries, MAX_LOG_BATCH_BYTES):
                    await send(wire.encode(wire.Logs(entries=batch)))
