"""Streams between a running input and its caller.

A synchronous stream's events reach the caller as it takes them; what it took is
acknowledged to the replica, which otherwise stops a window ahead (STREAM_WINDOW_BYTES),
so a slow caller holds the generator back rather than fill the control plane's memory.
A spawned call's stream, which nobody reads as it comes, is collected into its one
result, within a result's limit. A WebSocket session's messages from its caller go to
its replica, or wait for one to take the input.
"""

from __future__ import annotations

from ember.wire import messages as wire
from ember.wire.limits import MAX_FILE_RESULT_BYTES, MAX_RESULT_BYTES, MIB, STREAM_ACK_BYTES
from ember_platform.core.input_lifecycle import InputLifecycle
from ember_platform.observability.logs import LogSink
from ember_platform.runtime.inputs import CHUNK, EVENT, Input, Outcome, release_for
from ember_platform.runtime.live_state import LiveState


class StreamFlow:
    def __init__(self, state: LiveState, inputs: InputLifecycle, logs: LogSink) -> None:
        self.state = state
        self.inputs = inputs
        self.logs = logs

    def send_to_input(self, inp: Input, message: bytes) -> None:
        """A message for a running input (a WebSocket session's, from its caller): to its
        replica, or held until one takes it."""
        if inp.done:
            return
        replica = self.state.replicas.get(inp.replica_id or "")
        if replica is None or inp.id not in replica.inflight:
            inp.inbox = [*(inp.inbox or []), message]
            return
        replica.send(wire.InputMessage(id=inp.id), message)

    async def next_event(self, inp: Input) -> tuple[str, bytes | None]:
        """A synchronous stream's next item for its caller. What was taken is acknowledged
        to the replica, which otherwise stops a window ahead of the caller."""
        item = await inp.next_event()
        if item[0] in (EVENT, CHUNK):  # held since it came (an end or error was not)
            release_for(self.state.answers, inp, len(item[1] or b""))
        self._acknowledge(inp)
        return item

    def _acknowledge(self, inp: Input) -> None:
        if inp.taken_bytes - inp.acked_bytes < STREAM_ACK_BYTES:
            return
        inp.acked_bytes = inp.taken_bytes
        replica = self.state.replicas.get(inp.replica_id or "")
        if replica is not None and inp.id in replica.inflight:
            replica.send(wire.Ack(id=inp.id, bytes=inp.taken_bytes))

    def collect(self, inp: Input, data: bytes, size: int) -> None:
        """Keep an event of a spawned stream for its one result, within a result's limit:
        nobody reads it as it comes, so it cannot hold the generator back."""
        inp.collected.append(data)
        inp.collected_bytes += len(data) + 1  # with the comma of the JSON list
        limit = MAX_FILE_RESULT_BYTES if inp.file is not None else MAX_RESULT_BYTES
        if inp.collected_bytes > limit:
            inp.collected = []
            message = (
                f"{inp.label} streamed more than {limit // MIB} MiB to a spawned call, which "
                "keeps the stream as one result: call it with .stream() to read it as it "
                "comes, or store what it makes and return where it is"
            )
            runtime = self.state.runtime_of(inp)
            if runtime is not None:
                self.logs.system(runtime.app, runtime.spec.name, message, inp.replica_id)
            self.inputs.stop(inp, Outcome.error(500, "result_too_large", message))
            return
        inp.taken_bytes += size
        self._acknowledge(inp)
