"""A message from the control plane that does not fit its type (not JSON, a kind this
worker does not know, a field missing) is logged with why and dropped, on the agent's
channel and on a replica's, and what comes after it is still read. (Before the typed wire,
a line that was not JSON ended the replica's reading, and with it the replica, and
stopped the agent.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from runtime_harness import runtime_for

from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.control_channel import ControlChannel, NodeRefused, answer_to_hello

NOT_JSON = "not json"
UNKNOWN_KIND = '{"type": "self_destruct", "id": "i-0"}'


async def frames(*texts: str) -> AsyncIterator[str]:
    """A WebSocket's frames, as `async for` reads them."""
    for text in texts:
        yield text


def double(x: int) -> int:
    return 2 * x


class Recorded:
    """The replica's side of its channel: what it sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[wire.FromReplica, str]] = []

    async def send(self, text: str) -> None:
        self.sent.append(wire.from_replica(text))


def test_a_replica_drops_what_does_not_fit_and_serves_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def scenario() -> list[tuple[wire.FromReplica, str]]:
        channel = Recorded()
        runtime = runtime_for(double, channel)
        no_method = '{"type": "input", "id": "i-1"}\n{"x": 1}'
        good = wire.frame(wire.Input(id="i-2", method="__call__"), '{"x": 21}')
        batched = wire.RECORD_SEPARATOR.join([NOT_JSON, UNKNOWN_KIND, no_method, good])
        await runtime.channel.read(frames(batched), runtime._dispatch)
        while runtime.inputs.tasks:
            await asyncio.sleep(0.01)
        runtime.executor.shutdown()
        return channel.sent

    assert asyncio.run(scenario()) == [(wire.Result(id="i-2"), "42")]
    dropped = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("ember: dropped a message from the control plane: ")
    ]
    assert len(dropped) == 3
    assert "malformed" in dropped[0]
    assert "self_destruct" in dropped[1]
    assert "method" in dropped[2]


def agent_channel(tmp_path: Path, handled: list[wire.ToAgent]) -> ControlChannel:
    config = AgentConfig("https://127.0.0.1:1", "t", None, tmp_path, "node", 1.0, 1024)

    async def nothing() -> None:
        return None

    return ControlChannel(
        config,
        stopping=asyncio.Event(),
        leaving=asyncio.Event(),
        hello=lambda: wire.Hello(name="node", cpu=1.0, memory=1024),
        handle=handled.append,
        session_tasks=lambda ws: [],
        after_session=nothing,
    )


def test_an_agent_drops_what_does_not_fit_and_reads_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handled: list[wire.ToAgent] = []
    channel = agent_channel(tmp_path, handled)
    no_replica = '{"type": "kill_replica"}'
    good = wire.encode(wire.StopReplica(replica_id="r-1", grace=5))
    with caplog.at_level(logging.WARNING, logger="ember.worker"):
        asyncio.run(channel.read(frames(NOT_JSON, UNKNOWN_KIND, no_replica, good)))
    assert handled == [wire.StopReplica(replica_id="r-1", grace=5.0)]
    dropped = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(dropped) == 3
    assert "malformed" in dropped[0]
    assert "self_destruct" in dropped[1]
    assert "replica_id" in dropped[2]


def test_an_answer_to_the_hello_that_is_no_welcome_is_a_refusal() -> None:
    assert answer_to_hello('{"type": "welcome", "worker_id": "w-1"}') == wire.Welcome(
        worker_id="w-1"
    )
    with pytest.raises(NodeRefused, match="name taken"):
        answer_to_hello(wire.encode(wire.Refused(reason="name taken")))
    with pytest.raises(NodeRefused, match="not understood"):
        answer_to_hello(NOT_JSON)
    with pytest.raises(NodeRefused, match="not understood"):
        answer_to_hello(UNKNOWN_KIND)
    with pytest.raises(NodeRefused, match="not a welcome"):
        answer_to_hello(wire.encode(wire.KillReplica(replica_id="r")))
