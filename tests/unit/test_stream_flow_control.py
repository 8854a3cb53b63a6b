"""A stream's flow control: the control plane acknowledges what it took of a stream for
its caller, and a replica makes events only a window ahead of that; a spawned stream,
which nobody reads as it comes, is kept within a result's limit instead."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster_harness import Env, error_of, outcome_of, run
from runtime_harness import runtime_for

from ember.wire import messages as wire
from ember.wire.limits import MAX_RESULT_BYTES, STREAM_ACK_BYTES, STREAM_WINDOW_BYTES
from ember.wire.spec import FUNCTION_METHOD
from ember_platform.runtime.cluster_model import Replica
from ember_platform.runtime.inputs import END, EVENT
from ember_worker.replica.serving import ReplicaRuntime
from ember_worker.replica.stream_windows import StreamWindow

# --- the replica's side -------------------------------------------------------------------


def test_a_window_waits_once_more_than_its_size_is_unacknowledged() -> None:
    async def scenario() -> None:
        window = StreamWindow(size=100)
        await window.after_send(60)
        await window.after_send(40)  # exactly a window out: still goes on
        blocked = asyncio.ensure_future(window.after_send(1))
        await asyncio.sleep(0)
        assert not blocked.done() and window.outstanding == 101
        window.acknowledged(50)
        await asyncio.wait_for(blocked, 5)
        window.acknowledged(20)  # an older count changes nothing
        assert window.acked == 50
        # An event bigger than the window was sent whole; the stream then waits for it.
        big = asyncio.ensure_future(window.after_send(500))
        await asyncio.sleep(0)
        assert not big.done() and window.sent == 601
        window.acknowledged(601)
        await asyncio.wait_for(big, 5)
        assert window.outstanding == 0

    asyncio.run(scenario())


class Channel:
    def __init__(self) -> None:
        self.events = 0

    async def send(self, text: str) -> None:
        if isinstance(wire.from_replica(text)[0], wire.Event):
            self.events += 1


EVENT_CHARS = 1 << 20


def flood(count: int):
    for _ in range(count):
        yield "x" * (EVENT_CHARS - 2)  # 1 MiB of JSON with its quotes


async def held_back(runtime: ReplicaRuntime, sent: int = 0) -> None:
    """Until the input's stream waits for its window (after `sent` bytes, if given)."""
    for _ in range(3000):
        window = runtime.channel.windows.get("i-1")
        if window is not None and window.outstanding > window.size and window.sent >= sent:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the stream never reached its window")


def test_a_replica_stops_a_window_ahead_and_goes_on_when_acknowledged() -> None:
    async def scenario() -> None:
        channel = Channel()
        runtime = runtime_for(flood, channel)
        window_events = STREAM_WINDOW_BYTES // EVENT_CHARS
        start = wire.Input(id="i-1", method=FUNCTION_METHOD, stream=True)
        runtime._dispatch(wire.frame(start, '{"count": 40}'))
        # The event that crossed the window went; the next waits for an ack.
        await held_back(runtime)
        assert channel.events == window_events + 1
        runtime._dispatch(wire.frame(wire.Ack(id="i-1", bytes=4 * EVENT_CHARS)))
        await held_back(runtime, sent=(window_events + 5) * EVENT_CHARS)
        assert channel.events == window_events + 5
        runtime._dispatch(wire.frame(wire.Ack(id="i-1", bytes=40 * EVENT_CHARS)))
        await asyncio.wait_for(asyncio.gather(*runtime.inputs.tasks.values()), 30)
        assert channel.events == 40 and "i-1" not in runtime.channel.windows

    asyncio.run(scenario())


# --- the control plane's side -------------------------------------------------------------


def acks(env: Env, replica: Replica) -> list[int]:
    return [header["bytes"] for header, _ in env.sent(replica) if header["type"] == "ack"]


def test_what_a_caller_takes_is_acknowledged_every_quarter_window(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(streaming=True)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        half = b'"' + b"x" * (STREAM_ACK_BYTES // 2 - 2) + b'"'  # half an ack's worth
        for _ in range(5):
            env.reply(replica, "event", inp, half)
        assert acks(env, replica) == []  # arrived, but not taken for the caller yet
        assert await env.cluster.streams.next_event(inp) == (EVENT, half)
        assert acks(env, replica) == []
        await env.cluster.streams.next_event(inp)
        assert acks(env, replica) == [2 * len(half)]
        await env.cluster.streams.next_event(inp)
        await env.cluster.streams.next_event(inp)
        assert acks(env, replica) == [4 * len(half)]
        env.reply(replica, "end", inp)
        await env.cluster.streams.next_event(inp)
        assert await env.cluster.streams.next_event(inp) == (END, None)
        assert acks(env, replica) == []  # the end has no size

    run(tmp_path, scenario)


def test_a_spawned_stream_is_acknowledged_as_kept_and_stopped_past_a_results_limit(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(streaming=True)
        spawned = env.submit(is_async=True)
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        big = b'"' + b"x" * (MAX_RESULT_BYTES // 3) + b'"'
        env.reply(replica, "event", spawned, big)
        env.reply(replica, "event", spawned, big)
        assert acks(env, replica) == [len(big), 2 * len(big)]  # nobody reads it as it comes
        env.reply(replica, "event", spawned, big)
        status, (error_type, message) = outcome_of(spawned).status, error_of(outcome_of(spawned))
        assert (status, error_type) == (500, "result_too_large")
        assert "more than 64 MiB" in message and ".stream()" in message
        assert [h["type"] for h, _ in env.sent(replica)] == ["cancel"]  # its code is stopped
        assert spawned.collected == []
        # What it sends before its code stops is dropped; its slot frees once it has.
        env.reply(replica, "event", spawned, big)
        assert spawned.collected == [] and spawned.id in replica.inflight
        env.reply(replica, "cancelled", spawned)
        assert spawned.id not in replica.inflight
        assert "streamed more than 64 MiB to a spawned call" in env.logs()

    run(tmp_path, scenario)
