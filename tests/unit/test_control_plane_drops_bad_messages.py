"""What a worker or a replica sends that does not fit (not JSON, a kind the control plane
does not know, a field of the wrong type, a number out of range, an input or a replica
not its own) is logged, saying who sent it and why, and dropped: nothing else changes,
and the channel stays open. A replica runs its user's code, so what it says is checked,
never trusted. (Before the typed wire, a line that was not JSON ended a worker's session
and a replica's channel.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import Env, run
from starlette.websockets import WebSocketDisconnect

from ember.wire import messages as wire
from ember_platform.http.channels import Channels
from ember_platform.runtime.cluster_model import ReplicaState
from ember_platform.runtime.inputs import Input
from ember_platform.security.tokens import Scope, TokenRegistry


def dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped")]


def running(env: Env, count: int = 1) -> list[Input]:
    """`count` inputs, each on a ready replica of its own."""
    env.deploy(concurrency=1)
    inputs = [env.submit() for _ in range(count)]
    replicas = env.start_ready()
    assert len(replicas) == count
    for replica in replicas:
        env.sent(replica)
    return inputs


def test_a_replica_header_that_does_not_fit_is_logged_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(env: Env) -> None:
        (inp,) = running(env)
        (replica,) = env.cluster.replicas.values()
        caplog.set_level(logging.WARNING, "ember.channels")
        for text in (
            "not json\n42",
            '{"type": "result", "id": 7}\n42',  # an id that is not a string
            '{"type": "result"}\n42',  # no id
            '{"type": "self_destruct", "id": "x"}\n',  # a kind nobody knows
            # An HTTP status out of range.
            json.dumps({"type": "error", "id": inp.id, "status": 99999, "error_type": "x"}) + "\n",
            wire.frame(wire.Result(id=inp.id, media_type="image/png"), "abc"),  # not base64
        ):
            env.cluster.messages.from_replica(replica, text)
        lines = dropped(caplog)
        assert len(lines) == 6 and all(replica.id in line for line in lines)
        assert "Expected `str`, got `int`" in lines[1] and "self_destruct" in lines[3]
        assert ">= 400" in lines[4] or "<= 599" in lines[4]
        assert "not base64" in lines[5]
        assert not inp.done and replica.inflight == {inp.id: inp}
        env.reply(replica, "result", inp, b"42")  # the channel serves on
        assert inp.outcome.result().body == b"42"

    run(tmp_path, scenario)


def test_a_replica_may_speak_only_of_its_own_inputs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(env: Env) -> None:
        mine, theirs = running(env, 2)
        one = env.cluster.replicas[mine.replica_id or ""]
        other = env.cluster.replicas[theirs.replica_id or ""]
        caplog.set_level(logging.WARNING, "ember.channels")
        env.reply(one, "result", theirs, b'"forged"')
        env.reply(one, "error", theirs, error_type="x", message="forged")
        assert not theirs.done and other.inflight == {theirs.id: theirs}
        lines = dropped(caplog)
        assert len(lines) == 2 and all(one.id in line and theirs.id in line for line in lines)
        assert not mine.done
        env.reply(other, "result", theirs, b'"real"')
        assert theirs.outcome.result().body == b'"real"'

    run(tmp_path, scenario)


def test_huge_numbers_from_a_replica_change_nothing_else(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.submit()
        env.tick()
        (replica,) = env.started(env.commands())
        env.connect(replica)
        huge = "1" + "0" * 400  # an int no float holds
        out_of_range = '{"type": "ready", "start": {"boot_seconds": 1e999}}\n'
        env.cluster.messages.from_replica(replica, out_of_range)  # dropped
        assert replica.state is ReplicaState.STARTING
        start = f'{{"enter_seconds": {huge}}}'
        env.cluster.messages.from_replica(replica, f'{{"type": "ready", "start": {start}}}\n')
        assert replica.state is ReplicaState.STARTING  # a start report that does not fit
        start = '{"enter_seconds": 0.5, "x_seconds": 0.5, "kind": "restore"}'
        env.cluster.messages.from_replica(replica, f'{{"type": "ready", "start": {start}}}\n')
        assert replica.state is ReplicaState.READY and replica.start["enter_seconds"] == 0.5
        assert replica.start["kind"] == "restore" and "x_seconds" not in replica.start
        row = f'{{"name": "n", "kind": "counter", "labels": {{}}, "value": {huge}}}'
        beat = f'{{"type": "heartbeat", "weights": {{"chunks": {huge}}}, "metrics": [{row}]}}'
        env.cluster.messages.from_replica(replica, beat + "\n")
        exposition = env.cluster.metrics.exposition().decode()  # still renders
        assert "ember:user_n" not in exposition

    run(tmp_path, scenario)


def test_a_malformed_heartbeat_from_a_worker_is_logged_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(env: Env) -> None:
        (inp,) = running(env)
        (replica,) = env.cluster.replicas.values()
        env.say(wire.AgentHeartbeat(replica_memory={replica.id: 1000}))
        caplog.set_level(logging.WARNING, "ember.channels")
        env.worker.last_seen = 0.0
        for text in (
            json.dumps({"type": "heartbeat", "replica_memory": {replica.id: "lots"}}),
            '{"type": "heartbeat", "gpus": "none"}',
            "{",
        ):
            env.cluster.messages.from_worker(env.worker, text)
        lines = dropped(caplog)
        assert len(lines) == 3 and all(env.worker.id in line for line in lines)
        assert replica.memory_bytes == 1000
        assert env.worker.last_seen > time.time() - 5  # still a sign of life
        env.say(wire.AgentHeartbeat(replica_memory={replica.id: 2000}))
        assert replica.memory_bytes == 2000 and not inp.done

    run(tmp_path, scenario)


def test_a_worker_may_speak_only_of_its_own_replicas(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(env: Env) -> None:
        (inp,) = running(env)
        (replica,) = env.cluster.replicas.values()
        stranger = env.cluster.register_worker(wire.Hello(name="node-2", cpu=4, memory=8192))
        caplog.set_level(logging.WARNING, "ember.channels")
        env.say(wire.ReplicaExited(replica_id=replica.id, returncode=-9), stranger)
        env.say(wire.ReplicaMemoryIn(replica_id=replica.id, seconds=1.0), stranger)
        assert replica.id in env.cluster.replicas and not inp.done
        lines = dropped(caplog)
        assert len(lines) == 2 and all(stranger.id in line and replica.id in line for line in lines)

    run(tmp_path, scenario)


class FakeSocket:
    """A worker's WebSocket as `Channels.worker` uses it: `texts` are what the agent
    sends, then it hangs up (`at_end` runs first)."""

    def __init__(self, token: str, texts: list[str], at_end: Callable[[], None]) -> None:
        self.headers = {"authorization": f"Bearer {token}"}
        self.scope: dict[str, Any] = {"scheme": "ws"}
        self.texts = texts
        self.at_end = at_end
        self.sent: list[wire.ToAgent] = []
        self.closed_with: int | None = None

    async def accept(self) -> None:
        pass

    async def receive_text(self) -> str:
        await asyncio.sleep(0)
        if self.texts:
            return self.texts.pop(0)
        self.at_end()
        raise WebSocketDisconnect(1000)

    async def send_text(self, text: str) -> None:
        self.sent.append(wire.to_agent(text))

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code


def test_a_hello_not_understood_is_refused_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario(env: Env) -> None:
        tokens = TokenRegistry(env.store)
        token = tokens.create(Scope.WORKER, "test")
        channels = Channels(env.cluster, tokens)
        for first, why in (
            ('{"type": "hello", "name": "n"}', "missing required field `cpu`"),
            ('{"type": "heartbeat"}', "it sent AgentHeartbeat first, not a hello"),
            ("hello?", "its hello was not understood"),
        ):
            socket = FakeSocket(token, [first], lambda: None)
            await channels.worker(socket)  # type: ignore[arg-type]
            (answer,) = socket.sent
            assert isinstance(answer, wire.Refused) and why in answer.reason, answer
            assert socket.closed_with == 1008
        assert env.cluster.workers == {}
        # A hello that fits is welcomed; a message that does not fit after it is dropped,
        # and the session goes on.
        leaving: list[bool] = []
        texts = [wire.encode(wire.Hello(name="n", cpu=2, memory=1024)), "not json"]
        texts.append(wire.encode(wire.Leaving()))
        at_end = lambda: leaving.extend(w.leaving for w in env.cluster.workers.values())  # noqa: E731
        caplog.set_level(logging.WARNING, "ember.channels")
        socket = FakeSocket(token, texts, at_end)
        await channels.worker(socket)  # type: ignore[arg-type]
        assert isinstance(socket.sent[0], wire.Welcome) and leaving == [True]
        assert len(dropped(caplog)) == 1 and socket.sent[0].worker_id in dropped(caplog)[0]

    run(tmp_path, scenario, with_worker=False)
