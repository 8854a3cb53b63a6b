"""A control plane that took over (or restarted) adopts the replicas a worker's hello names
when they are of the version deployed now, and stops the others; adopted ones are ready
once their channel opens again, and take inputs."""

from __future__ import annotations

from pathlib import Path

from cluster_harness import LABEL, Env, hello, outcome_of, run

from ember.wire import messages as wire
from ember.wire.labels import make_label
from ember_platform.core.cluster_model import ReplicaState


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
        env.cluster.replica_message(adopted, wire.frame(wire.Ready(start={"kind": "adopted"})))
        assert adopted.state is ReplicaState.READY
        assert adopted.start["kind"] == "adopted"
        inp = env.submit()
        env.tick()
        assert env.inputs_sent(adopted) == [inp.id]
        env.reply(adopted, "result", inp, b'{"ok": true}')
        assert outcome_of(inp).status == 200

    run(tmp_path, scenario, with_worker=False)


def test_past_the_reconnect_grace_a_named_replica_is_stopped(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(version=1)
        worker = env.cluster.register_worker(hello(replicas=[_held("r-late")]))
        commands = env.commands(worker)
        assert "r-late" not in env.cluster.replicas
        assert [c["replica_id"] for c in commands if c["type"] == "stop_replica"] == ["r-late"]

    run(tmp_path, scenario, with_worker=False, reconnect_grace_seconds=0.0)
