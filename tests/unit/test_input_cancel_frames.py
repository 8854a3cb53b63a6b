"""A replica answers every cancel with `cancelled`, however early the cancel comes: until
it does, the platform counts the input as running and keeps its slot taken."""

from __future__ import annotations

import asyncio
import json
import time

from runtime_harness import runtime_for

import ember
from ember.wire import messages as wire
from ember_worker.replica.serving import ReplicaRuntime

# How each call of `patient` ended, in order: read as each frame is sent.
ENDINGS: list[str] = []


class RecordedChannel:
    """Stands in for the replica's side of its channel: keeps the frames it is sent, each
    with the calls of `patient` that had ended by then."""

    def __init__(self) -> None:
        self.headers: list[wire.FromReplica] = []
        self.ended_before: list[list[str]] = []

    async def send(self, text: str) -> None:
        self.headers.append(wire.from_replica(text)[0])
        self.ended_before.append(list(ENDINGS))


def patient(seconds: float, deaf_for: float = 0.0) -> dict:
    """Stops early once cancelled, but not in its first `deaf_for` seconds."""
    began = time.monotonic()
    while (elapsed := time.monotonic() - began) < seconds:
        if ember.cancelled() and elapsed >= deaf_for:
            ENDINGS.append("stopped")
            return {"stopped": True}
        time.sleep(0.01)
    ENDINGS.append("ran out")
    return {"stopped": False}


def runtime_with_channel() -> tuple[ReplicaRuntime, RecordedChannel]:
    channel = RecordedChannel()
    return runtime_for(patient, channel, concurrency=2), channel


def input_frame(input_id: str, seconds: float, deaf_for: float = 0.0) -> str:
    arguments = json.dumps({"seconds": seconds, "deaf_for": deaf_for})
    return wire.frame(wire.Input(id=input_id, method="__call__"), arguments)


async def settle(runtime: ReplicaRuntime) -> None:
    """Until every input has ended and every frame their ends send has gone."""
    while runtime.inputs.tasks or runtime.inputs.sending:
        await asyncio.sleep(0.01)


def test_a_cancel_in_the_same_read_as_its_input_is_answered() -> None:
    async def scenario() -> list[wire.FromReplica]:
        runtime, channel = runtime_with_channel()
        cancel = wire.frame(wire.Cancel(id="c-early"))
        # One read from the channel carries both; the input's task has not run a step.
        for message in (input_frame("c-early", 30), cancel):
            runtime._dispatch(message)
        await settle(runtime)
        runtime.executor.shutdown()
        return channel.headers

    assert asyncio.run(scenario()) == [wire.Cancelled(id="c-early")]


def test_a_running_input_cancelled_twice_waits_for_its_thread_and_says_so_once() -> None:
    async def scenario() -> RecordedChannel:
        ENDINGS.clear()
        runtime, channel = runtime_with_channel()
        runtime._dispatch(input_frame("c-running", 30, deaf_for=0.6))
        await asyncio.sleep(0.1)  # its thread is in the code
        runtime._dispatch(wire.frame(wire.Cancel(id="c-running")))
        await asyncio.sleep(0.1)  # the task now waits for the thread, which goes on a while
        runtime._dispatch(wire.frame(wire.Cancel(id="c-running")))
        await settle(runtime)
        runtime.executor.shutdown()
        return channel

    channel = asyncio.run(scenario())
    assert channel.headers == [wire.Cancelled(id="c-running")]
    # Said once the code had stopped early (it ignored the cancel a while), not at the
    # second cancel while it still ran.
    assert channel.ended_before == [["stopped"]]


def test_a_cancel_for_an_input_that_finished_sends_nothing_more() -> None:
    async def scenario() -> list[wire.FromReplica]:
        runtime, channel = runtime_with_channel()
        runtime._dispatch(input_frame("c-quick", 0))
        await settle(runtime)
        runtime._dispatch(wire.frame(wire.Cancel(id="c-quick")))
        await settle(runtime)
        runtime.executor.shutdown()
        return channel.headers

    headers = asyncio.run(scenario())
    assert [type(h) for h in headers] == [wire.Result]
