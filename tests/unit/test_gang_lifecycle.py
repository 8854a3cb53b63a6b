"""Replicas that span several nodes (gangs), as the control plane runs them: placed whole
or not at all, each member told its rank and its gang's ports, rank 0 taking the inputs
once every member is ready, and any member's loss ending the gang and retrying its
inputs. Workers and replicas are played by the test (cluster_harness)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import Env, hello, outcome_of, run

import ember
from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember.wire import messages as wire
from ember.wire.gangs import GangMember
from ember_platform.runtime.cluster_model import Replica, ReplicaState, Worker
from ember_platform.runtime.inputs import Outcome
from ember_platform.scaling.gang_ports import GANG_PORTS, free_block
from ember_platform.scaling.scheduler import Demand, NodeCapacity, place_gang, unservable_reason
from ember_worker.replica.results import ResultSender


def node(name: str, cpu: float = 4.0, **fields: Any) -> NodeCapacity:
    """A node of machine "m1" (its loopback) unless `loopback=` says otherwise."""
    fields.setdefault("loopback", "m1")
    return NodeCapacity(name, cpu, 8192, fields.pop("gpus", {}), **fields)


LOOPBACK = "boot-1:4026531840"  # the workers' one machine, in the tests below


def test_a_gang_is_placed_on_distinct_nodes_whole_or_not_at_all() -> None:
    gang = Demand(cpu=2.0, memory=512, gpus=(), bundle_digest="b", label="a--e", nodes=2)
    nodes = [node("a"), node("b", cpu_used=3.0), node("c")]
    placed = place_gang(gang, nodes)
    assert placed is not None
    assert sorted(p.worker_id for p in placed) == ["a", "c"]  # b has 1 CPU free of the 2
    # Only one node has room: nothing is placed (no member holds a node meanwhile).
    assert place_gang(gang, [node("a"), node("b", cpu_used=3.0)]) is None


def test_a_gangs_members_share_one_gpu_choice_the_first_that_fits_them_all() -> None:
    gang = Demand(1.0, 512, (("H100", 8), ("A100", 8)), "b", label="a--e", nodes=2)
    nodes = [node("a", gpus={"H100": 8, "A100": 8}), node("b", gpus={"A100": 8})]
    placed = place_gang(gang, nodes)
    assert placed is not None and {p.gpu for p in placed} == {("A100", 8)}


def test_a_gang_more_nodes_could_never_hold_says_what_is_missing() -> None:
    gang = Demand(cpu=2.0, memory=512, gpus=(), bundle_digest="b", nodes=3)
    reason = unservable_reason(gang, [node("a"), node("b"), node("tiny", cpu=1.0)])
    assert reason is not None and reason.startswith("the replica is a gang of 3 members")
    assert "at most 2 nodes of one machine could run one (cpu=2, memory=512 MiB)" in reason
    assert "join 1 more to the same machine" in reason
    assert unservable_reason(gang, [node("a"), node("b"), node("c")]) is None


def test_a_gangs_members_meet_on_one_loopback_so_it_lands_on_one_machine() -> None:
    gang = Demand(cpu=1.0, memory=512, gpus=(), bundle_digest="b", label="a--e", nodes=2)
    apart = [node("a", loopback="m1"), node("b", loopback="m2")]
    assert place_gang(gang, apart) is None
    reason = unservable_reason(gang, apart)
    assert reason is not None and "they meet on its loopback" in reason
    nodes = [*apart, node("c", loopback="m2")]
    placed = place_gang(gang, nodes)
    assert placed is not None and sorted(p.worker_id for p in placed) == ["b", "c"]


def test_gang_ports_are_blocks_no_two_live_gangs_share() -> None:
    first, end = GANG_PORTS
    assert free_block(64, []) == first
    assert free_block(64, [(first, 64)]) == first + 64
    assert free_block(10, [(first, 5), (first + 20, 5)]) == first + 5  # a gap that fits
    assert free_block(10, [(first, 5), (first + 12, 5)]) == first + 17  # one that does not
    assert free_block(end - first + 1, []) is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nodes": 0}, "nodes=0 is out of range"),
        ({"gang_ports": 1}, "gang_ports=1 is out"),
        ({"nodes": 4, "gang_ports": 1024}, "4096 ports; a gang may hold at most 2048"),
        ({"gang_inputs": "all"}, "gang_inputs='all': use 'rank0'"),
    ],
)
def test_gang_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        EndpointSettings(**settings)


def test_a_web_apps_requests_go_to_rank_0_alone() -> None:
    with pytest.raises(InvalidError, match="drop gang_inputs='every_rank'"):

        @ember.endpoint(nodes=2, gang_inputs="every_rank")
        @ember.asgi_app()
        def web() -> Any:
            return None


def start_gang(env: Env, **settings: Any) -> tuple[list[Replica], list[dict[str, Any]], Worker]:
    """A second node joins, a gang of two is deployed and asked for: its members (by
    rank) and their start commands."""
    env.worker.loopback = LOOPBACK
    other = env.cluster.register_worker(hello(name="node-b", loopback=LOOPBACK))
    env.deploy(nodes=2, max_replicas=1, gang_ports=16, **settings)
    env.submit()
    env.tick()
    members, starts, _ = next_gang(env, other)
    return members, starts, other


def test_each_member_is_told_its_rank_and_ports_and_rank_0_serves_once_all_are_ready(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        members, starts, other = start_gang(env)
        assert len(members) == 2 and {m.worker_id for m in members} == {env.worker.id, other.id}
        places = [GangMember(**c["gang"]) for c in starts]
        assert [p.rank for p in places] == [0, 1]
        assert {p.gang_id for p in places} == {members[0].gang.id}  # type: ignore[union-attr]
        assert all(p.size == 2 and p.ports_each == 16 for p in places)
        assert places[0].ports_of(1) == (places[0].first_port + 16, places[0].first_port + 31)
        # Only rank 0 is the endpoint's: the autoscaler counts one replica.
        assert list(env.runtime.replicas.values()) == [members[0]]
        lead, member = members
        env.ready(lead)
        assert lead.state is ReplicaState.STARTING  # its peer is not ready yet
        assert env.inputs_sent(lead) == []
        env.ready(member)
        assert lead.state is ReplicaState.READY and member.state is ReplicaState.READY
        assert len(env.inputs_sent(lead)) == 1
        assert env.inputs_sent(member) == []  # members take no inputs of their own
        env.tick()
        assert env.commands() == [] and env.commands(other) == []  # no second gang

    run(tmp_path, scenario)


def test_with_every_rank_each_member_runs_a_copy_and_rank_0_answers(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        members, _, _ = start_gang(env, gang_inputs="every_rank", concurrency=2)
        lead, member = members
        for replica in (member, lead):
            env.ready(replica)
        (first,) = lead.inflight.values()
        (copy,) = [(h, b) for h, b in env.sent(member) if h["type"] == "input"]
        assert copy[0]["id"] == first.id and copy[0]["echo"] is True and copy[1] == first.body
        assert [h.get("echo", False) for h, _ in env.sent(lead) if h["type"] == "input"] == [False]
        # What a copy sends is not kept, and costs its channel nothing: rank 0 answers.
        env.reply(member, "event", first, b'"from rank 1"')
        env.reply(member, "result", first, b'"rank 1"')
        assert not first.done and member.outbox is not None
        env.reply(lead, "result", first, b'"rank 0"')
        assert outcome_of(first) == Outcome(200, b'"rank 0"')
        # A copy's failure is the call's, named by its rank; rank 0's run is stopped.
        second = env.submit()
        env.sent(lead), env.sent(member)
        env.reply(member, "error", second, status=500, error_type="ValueError", message="bad")
        assert outcome_of(second) == Outcome.error(500, "ValueError", "rank 1 of its gang: bad")
        assert {"type": "cancel", "id": second.id} in [h for h, _ in env.sent(lead)]
        # A caller that leaves stops every copy.
        third = env.submit()
        env.cluster.input_lifecycle.cancel(third, "the caller went")
        for replica in members:
            assert {"type": "cancel", "id": third.id} in [h for h, _ in env.sent(replica)]

    run(tmp_path, scenario)


def test_with_rank_0_taking_inputs_a_member_cannot_end_one(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        members, _, _ = start_gang(env)
        lead, member = members
        for replica in (member, lead):
            env.ready(replica)
        (running,) = lead.inflight.values()
        env.reply(member, "error", running, status=500, error_type="ValueError", message="no")
        assert not running.done
        env.reply(lead, "result", running, b'"ok"')
        assert outcome_of(running) == Outcome(200, b'"ok"')

    run(tmp_path, scenario)


def test_each_rank_takes_and_restores_an_image_of_its_own(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        support = {"env_key": "node-env"}
        env.worker.snapshots = dict(support)
        env.worker.loopback = LOOPBACK
        other = env.cluster.register_worker(
            hello(name="node-b", snapshots=support, loopback=LOOPBACK)
        )
        env.deploy(nodes=2, max_replicas=1)
        env.submit()
        env.tick()
        starts = [c for c in env.commands() + env.commands(other) if c["type"] == "start_replica"]
        plans = {c["gang"]["rank"]: c["snapshot"] for c in starts}
        assert {plan["action"] for plan in plans.values()} == {"take"}
        assert plans[0]["key"] != plans[1]["key"]  # a rank's share is its own

    run(tmp_path, scenario)


def test_a_lost_member_ends_its_gang_and_its_inputs_run_on_the_next(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        members, _, other = start_gang(env)
        lead, member = members
        for replica in members:
            env.ready(replica)
        (running,) = env.runtime.pending or [next(iter(lead.inflight.values()))]
        env.say(wire.ReplicaExited(replica_id=member.id, returncode=-9), worker_of(env, member))
        assert not any(m.id in env.cluster.replicas for m in members)
        kill = {"type": "kill_replica", "replica_id": lead.id}
        assert kill in env.commands(worker_of(env, lead))
        assert list(env.runtime.pending) == [running]  # retried, not failed
        assert f"rank 1 of its gang {lead.gang.id} was lost" in env.logs()  # type: ignore[union-attr]
        env.tick()
        (new_lead, new_member), _, _ = next_gang(env, other)
        for replica in (new_member, new_lead):
            env.ready(replica)
        assert env.inputs_sent(new_lead) == [running.id]
        env.reply(new_lead, "result", running, b'"ok"')
        assert outcome_of(running) == Outcome(200, b'"ok"')

    run(tmp_path, scenario)


def worker_of(env: Env, replica: Replica) -> Worker:
    return env.cluster.workers[replica.worker_id]


def next_gang(env: Env, other: Worker) -> tuple[list[Replica], list[dict[str, Any]], None]:
    commands = env.commands() + env.commands(other)
    starts = sorted(
        (c for c in commands if c["type"] == "start_replica"), key=lambda c: c["gang"]["rank"]
    )
    return [env.cluster.replicas[c["replica_id"]] for c in starts], starts, None


def test_draining_a_member_stops_the_whole_gang_after_its_inputs(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        members, _, other = start_gang(env)
        lead, member = members
        for replica in members:
            env.ready(replica)
        (running,) = lead.inflight.values()
        env.cluster.replica_lifecycle.drain(member)  # `ember replica stop` on rank 1
        assert lead.state is ReplicaState.DRAINING and member.state is ReplicaState.READY
        env.reply(lead, "result", running, b'"done"')
        assert outcome_of(running) == Outcome(200, b'"done"')
        stops = [c for c in env.commands() + env.commands(other) if c["type"] == "stop_replica"]
        assert sorted(c["replica_id"] for c in stops) == sorted(m.id for m in members)
        # The members end in turn; the first to go takes nothing else down.
        env.say(wire.ReplicaExited(replica_id=member.id, returncode=0), worker_of(env, member))
        assert lead.id in env.cluster.replicas
        env.say(wire.ReplicaExited(replica_id=lead.id, returncode=0), worker_of(env, lead))
        assert env.cluster.replicas == {}

    run(tmp_path, scenario)


def test_a_gang_that_does_not_fit_now_holds_nothing_and_says_why(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.worker.loopback = LOOPBACK
        env.cluster.register_worker(hello(name="node-b", cpu=1.0, loopback=LOOPBACK))
        env.cluster.roster.started_at = time.time() - 3600.0
        env.deploy(nodes=2, cpu=1.5, max_replicas=1)
        assert env.cluster.roster.unservable_reason(env.runtime) is not None  # node-b never fits
        env.cluster.register_worker(hello(name="node-c", cpu=4.0, loopback=LOOPBACK))
        assert env.cluster.roster.unservable_reason(env.runtime) is None
        env.cluster.register_worker(hello(name="busy", cpu=4.0, loopback=LOOPBACK))
        inp = env.submit()
        for worker in env.cluster.workers.values():  # every node but one takes none now
            worker.leaving = worker.name != "node-c"
        env.tick()
        assert not inp.done and env.cluster.replicas == {}
        assert env.runtime.placement_wait == (
            "waiting for 2 nodes with room for a gang member (cpu=1.5, memory=512 MiB); "
            "1 have room now"
        )

    run(tmp_path, scenario)


def test_a_gangs_ports_stay_taken_until_every_member_has_ended(tmp_path: Path) -> None:
    """A member killed may listen a while yet: no other gang gets its ports until its
    worker says its process ended (or the worker leaves)."""

    async def scenario(env: Env) -> None:
        members, starts, other = start_gang(env)
        first = starts[0]["gang"]["first_port"]
        env.cluster.input_lifecycle.replica_lost(members[1], "killed by a test")
        assert env.cluster.replicas == {}
        assert env.cluster.state.gang_ports_taken() == [(first, 32)]
        for member in members:
            env.say(wire.ReplicaExited(replica_id=member.id, returncode=-9), worker_of(env, member))
            if member is members[0]:
                assert env.cluster.state.gang_ports_taken() == [(first, 32)]
        assert env.cluster.state.gang_ports_taken() == []
        # An exit reported by a worker that did not run the member frees nothing.
        members, starts, other = next_gang_after_tick(env, other)
        stranger = env.worker if members[1].worker_id != env.worker.id else other
        env.say(wire.ReplicaExited(replica_id=members[1].id, returncode=0), stranger)
        assert len(env.cluster.state.gang_ports_taken()) == 1

    run(tmp_path, scenario)


def next_gang_after_tick(env: Env, other: Worker) -> tuple[list[Replica], list[Any], Worker]:
    env.tick(time.time() + 5.0)  # past the lost gang's start backoff
    members, starts, _ = next_gang(env, other)
    return members, starts, other


def test_a_restarted_control_plane_keeps_the_ports_its_workers_old_members_hold(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        place = GangMember(
            gang_id="g-old",
            rank=1,
            size=2,
            master_addr="127.0.0.1",
            first_port=24000,
            ports_each=32,
        )
        held = wire.HeldReplica(
            replica_id="r-old", token="t", label="demo--fn", version=1, gang=place
        )
        box = env.cluster.register_worker(hello(name="node-b", replicas=[held]))
        assert {"type": "stop_replica", "replica_id": "r-old", "grace": 30.0} in [
            {k: c[k] for k in ("type", "replica_id", "grace") if k in c} for c in env.commands(box)
        ]
        assert env.cluster.state.gang_ports_taken() == [(24000, 64)]
        env.say(wire.ReplicaExited(replica_id="r-old", returncode=0), box)
        assert env.cluster.state.gang_ports_taken() == []

    run(tmp_path, scenario)


def test_one_workspaces_gangs_hold_no_more_than_its_share_of_the_ports(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.worker.loopback = LOOPBACK
        other = env.cluster.register_worker(hello(name="node-b", loopback=LOOPBACK))
        env.deploy(nodes=2, max_replicas=2, gang_ports=1024, cpu=0.5)
        env.submit()
        env.submit()
        env.tick()
        starts = [c for c in env.commands() + env.commands(other) if c["type"] == "start_replica"]
        assert len(starts) == 2  # one gang of two: 2048 ports, its workspace's share
        assert env.runtime.placement_wait == (
            "no room for a gang: its workspace's gangs hold 2048 of the 2048 gang ports a "
            "workspace may hold, and it needs 2 x 1024"
        )

    run(tmp_path, scenario)


def test_a_members_copy_sends_only_how_it_ended() -> None:
    sent: list[tuple[wire.FromReplica, str]] = []

    async def send(header: wire.FromReplica, body: str = "") -> None:
        sent.append((header, body))

    async def scenario() -> None:
        results = ResultSender(send)
        results.echo("copy")
        await results.event("copy", len, "x" * 10_000)
        await results.result("copy", len, "rank 1's")
        await results.event("own", len, "y")
        results.forget("copy")
        await results.result("copy", len, "z")  # an id used again is not a copy

    asyncio.run(scenario())
    assert [(type(h).__name__, h.id, b) for h, b in sent] == [
        ("End", "copy", ""),
        ("Event", "own", '"y"'),
        ("Result", "copy", '"z"'),
    ]
