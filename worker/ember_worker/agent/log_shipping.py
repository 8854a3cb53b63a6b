"""Lines for the control plane's logs: what replicas print, the agent's notes into a
replica's log, and the node's lines into an endpoint's log. Buffered here and sent in
batches every tenth of a second, each small enough for one channel message."""

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
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.processes.replica_processes import open_reader
from ember_worker.replica.call_tagged_output import split_tag

log = logging.getLogger("ember.worker")

LOG_FLUSH_SECONDS = 0.1

Note = Callable[[RunningReplica, str], None]  # a line from the agent into a replica's log
EndpointNote = Callable[[str, str], None]  # a line of the node's into an endpoint's (label)
SendText = Callable[[str], Awaitable[None]]  # a message onto the channel, as it is


def log_batches(entries: list[dict[str, Any]], max_bytes: int) -> Iterator[list[dict[str, Any]]]:
    """The entries in order, cut into batches of about `max_bytes` of text at most, so
    that a replica printing fast never makes one channel message too large."""
    batch: list[dict[str, Any]] = []
    size = 0
    for entry in entries:
        entry_size = len(entry["text"]) + 200  # the text and its fields, roughly
        if batch and size + entry_size > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry_size
    if batch:
        yield batch


class LogShipper:
    def __init__(self) -> None:
        self.buffer: list[dict[str, Any]] = []  # what the next flush sends

    def note(self, replica: RunningReplica, text: str) -> None:
        """A line from the agent into the replica's own log."""
        log.info("replica %s: %s", replica.replica_id, text)
        self.buffer.append(
            {
                "ts": time.time(),
                "app": replica.app,
                "endpoint": replica.endpoint,
                "replica": replica.replica_id,
                "stream": "ember",
                "text": text,
            }
        )

    def endpoint_note(self, label: str, text: str) -> None:
        """A line of this node's into its log and into the endpoint's, beside the
        platform's lines."""
        log.info("%s", text)
        parts = split_label(label)
        if parts is not None:
            app, endpoint = parts
            entry = {"ts": time.time(), "app": app, "endpoint": endpoint, "stream": "ember"}
            self.buffer.append({**entry, "text": text})

    async def ship_output(self, replica: RunningReplica, fd: int, name: str) -> None:
        """The lines of the replica's `name` pipe (stdout, stderr), until it closes."""
        pipe = await open_reader(os.dup(fd))
        try:
            await self._read_lines(replica, pipe.reader, name)
        finally:
            pipe.close()

    async def _read_lines(
        self, replica: RunningReplica, stream: asyncio.StreamReader, name: str
    ) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the stream limit: take what is there
                raw = await stream.read(65536)
            if not raw:
                return
            call, text = split_tag(raw.decode(errors="replace").rstrip("\n"))
            if name == "stderr":
                replica.stderr_tail.append((time.monotonic(), text))
            entry = {
                "ts": time.time(),
                "app": replica.app,
                "endpoint": replica.endpoint,
                "replica": replica.replica_id,
                "stream": name,
                "text": text,
            }
            if call is not None:
                entry["call"] = call
            self.buffer.append(entry)

    async def flush_to(self, send: SendText) -> None:
        """Send what is buffered, every LOG_FLUSH_SECONDS, for as long as the channel's
        session lasts (it cancels this)."""
        while True:
            await asyncio.sleep(LOG_FLUSH_SECONDS)
            if self.buffer:
                entries, self.buffer = self.buffer, []
                for batch in log_batches(entries, MAX_LOG_BATCH_BYTES):
                    await send(wire.encode(wire.Logs(entries=batch)))
