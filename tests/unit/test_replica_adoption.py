"""A control plane that took over (or restarted) adopts the replicas a worker's hello names
when they are of the version deployed now, and stops the others; adopted ones are ready
once their channel opens again, and take inputs."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from cluster_harness import LABEL, Env, hello, outcome_of, run

from ember.wire import messages as wire
from ember.wire.labels import make_label
from ember_platform.runtime.cluster_model import ReplicaState


def _held(replica_id: str, version: int = 1, label: str = LABEL) -> wire.HeldReplica:
    return wire.HeldReplica(
        replica_id=replica_id, token="tok-" + replica_id, label=label, version=version
    )


def test_a_fresh_owner_adopts_the_deployed_version_and_stops_the_rest(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(version=2)
        held = [_held("r-current", 2), _held("r-old", 1), _held("r-gone", 2, make_label("x", "y"))]
        worker = env.cluster.register_worker(hello(replicas=held))
        stopped = [c["replica_id"] for c in env.commands(worker) if c["type"] == "stop_replica"]
        assert sorted(stopped) == ["r-gone", "r-old"]
        adopted = env.cluster.replicas["r-current"]
        assert adopted.token == "tok-r-current" and adopted.worker_id == worker.id
        assert adopted.state is ReplicaState.STARTING
        env.connect(adopted)
        env.cluster.messages.from_replica(
            adopted, wire.frame(wire.Ready(start={"kind": "adopted"}))
        )
        assert adopted.state is ReplicaState.READY
        assert adopted.start["kind"] == "adopted"
        inp = env.submit()
        env.tick()
        assert env.inputs_sent(adopted) == [inp.id]
        env.reply(adopted, "result", inp, b'{"ok": true}')
        assert outcome_of(inp).status == 200

    run(tmp_path, scenario, with_worker=False)


def test_a_hello_past_the_reconnect_grace_still_has_its_replicas_adopted(tmp_path: Path) -> None:
    """A worker slow to say hello (a loaded machine, a long backoff) loses nothing: its
    replicas were never this process's, so it adopts them whenever the hello comes."""

    async def scenario(env: Env) -> None:
        env.deploy(version=1)
        worker = env.cluster.register_worker(hello(replicas=[_held("r-late")]))
        assert "r-late" in env.cluster.replicas
        assert [c for c in env.commands(worker) if c["type"] == "stop_replica"] == []

    run(tmp_path, scenario, with_worker=False, reconnect_grace_seconds=0.0)


def test_a_replica_this_process_let_go_is_stopped_when_a_hello_names_it(tmp_path: Path) -> None:
    """Its worker's channel closed, so this process gave its replica up as lost (its
    inputs went elsewhere); the worker comes back still running it: it is stopped, not
    adopted back. Likewise one this process scaled down."""

    async def scenario(env: Env) -> None:
        env.deploy(version=1)
        worker = env.cluster.register_worker(hello(replicas=[_held("r-1"), _held("r-2")]))
        first, second = env.cluster.replicas["r-1"], env.cluster.replicas["r-2"]
        for replica in (first, second):
            env.connect(replica)
            env.cluster.messages.from_replica(
                replica, wire.frame(wire.Ready(start={"kind": "adopted"}))
            )
        env.cluster.replica_lifecycle.drain(second)  # scaled down: stopping
        env.say(wire.ReplicaExited(replica_id=second.id, returncode=0), worker)
        assert "r-2" not in env.cluster.replicas
        env.cluster.roster.gone(worker, "disconnected")
        assert env.cluster.replicas == {}
        back = env.cluster.register_worker(hello(replicas=[_held("r-1"), _held("r-2")]))
        stopped = [c["replica_id"] for c in env.commands(back) if c["type"] == "stop_replica"]
        assert sorted(stopped) == ["r-1", "r-2"] and env.cluster.replicas == {}

    run(tmp_path, scenario, with_worker=False)


def test_over_its_cap_a_new_owner_keeps_the_adopted_replicas_that_ran_longest(
    tmp_path: Path,
) -> None:
    """A takeover: the first worker to say hello has no replica of the endpoint, so one is
    started for a queued input; then the second worker's hello names one that has run for
    two minutes. Two replicas with max_replicas=1: the one just started drains (busy, it
    finishes its input first), and the warm one serves on."""

    async def scenario(env: Env) -> None:
        env.deploy(version=1, max_replicas=1)
        inp = env.submit()
        (started,) = env.start_ready()
        assert env.inputs_sent(started) == [inp.id]
        held = msgspec.structs.replace(_held("r-warm"), running_seconds=120.0)
        other = env.cluster.register_worker(hello(name="node-2", replicas=[held]))
        warm = env.cluster.replicas["r-warm"]
        assert warm.worker_id == other.id
        assert warm.created_at - warm.placed_at == pytest.approx(120.0)
        env.connect(warm)
        env.cluster.messages.from_replica(warm, wire.frame(wire.Ready(start={"kind": "adopted"})))
        env.tick()
        assert started.state is ReplicaState.DRAINING and warm.state is ReplicaState.READY
        assert "more replicas than max_replicas=1" in env.logs()
        env.reply(started, "result", inp, b'{"ok": true}')
        assert outcome_of(inp).status == 200  # its input was not lost to the drain
        assert started.state is ReplicaState.STOPPING
        later = env.submit()
        env.tick()
        assert env.inputs_sent(warm) == [later.id]

    run(tmp_path, scenario)


def test_a_hello_says_how_long_each_replica_has_run_on_its_node() -> None:
    from ember_worker.agent.running_replica import RunningReplica

    record = RunningReplica("r-1", "demo", "fn")
    assert record.held_now() is None  # no process yet: nothing to adopt
    record.held = _held("r-1")
    record.placed_at -= 42.0  # placed 42 s ago, on the node's monotonic clock
    held = record.held_now()
    assert held is not None and 42.0 <= held.running_seconds < 50.0
    assert held.replica_id == "r-1" and record.held.running_seconds == 0.0  # a copy
    decoded = wire.from_agent(wire.encode(hello(replicas=[held])))  # what the wire carries
    assert isinstance(decoded, wire.Hello)
    assert decoded.replicas[0].running_seconds == held.running_seconds


def test_replicas_let_go_are_remembered_for_ten_minutes() -> None:
    from ember_platform.runtime.live_state import ENDED_REPLICA_MEMORY_S, LiveState

    state = LiveState()
    state.replica_ended("r-old", 1000.0)
    state.replica_ended("r-new", 1300.0)
    assert list(state.ended_replicas) == ["r-old", "r-new"]
    state.replica_ended("r-newer", 1000.0 + ENDED_REPLICA_MEMORY_S)
    assert list(state.ended_replicas) == ["r-new", "r-newer"]
