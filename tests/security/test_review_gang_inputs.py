"""A reviewer's attacks on `gang_inputs="every_rank"` (each input of a gang's rank 0 also
sent to every other member as a copy, `wire.Input.echo`; a member's word on a copy
counts only as an Error or an unasked Cancelled), by a tenant whose replica code, every
member of its gangs included, sends whatever it likes on its channels.

The control plane is driven as in tests/unit (cluster_harness: a real `Cluster`, its
workers and replicas played by the test). The attacker is workspace `mallory`; the
victims are `alice`'s calls and mallory's own other endpoints. Each test is the
attacker's action and an outcome seen in the control plane (a call's outcome, what it
holds, what it sent a replica).

Found, each mended (its test failed before):

- a member that never reads its channel had a copy of every input of its rank 0
  queued for it (an unbounded `Replica.outbox`; channels have no ping), long after the
  calls ended: rank 0 now takes no more inputs than each member has room for beside
  the copies it has not ended (`Gang.behind`), so the calls wait in the queue;
- rank 0 sending its result after the cancel a member's error caused had the result
  counted in its workspace's held bytes for good (the same for a caller's cancel
  before every_rank): an input that ended holds nothing of its late answer;
- a lazily restored replica's messages were held without bound until its memory was
  in (`replica.held`): they count in its workspace's held answers (its channel pauses
  past the budget), and past a result's worth the replica is lost;
- a hand-made manifest deployed a web app with every_rank (only the decorator refused
  it): the manifest's endpoint spec refuses it too.

Held: a member names no call but its rank 0's (of another workspace, another
endpoint, or with the default rank0, nothing it sends counts); what a member sends
about its copy is not kept; an Error of 4 MiB with odd characters fails only that
call, as JSON, and rank 0's slot is freed once it stops; a lazily restored member's
held messages go through the same checks; a bad `gang_inputs` is refused at deploy.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from cluster_harness import DIGEST, Env, hello, outcome_of, run

from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember.wire import messages as wire
from ember.wire.labels import make_label
from ember.wire.spec import FUNCTION_METHOD, AppManifest, EndpointSpec, MethodSpec
from ember_platform.limits.held_bytes import MIB
from ember_platform.runtime.cluster_model import Replica, Worker
from ember_platform.runtime.inputs import Input, Outcome
from ember_platform.storage.records import Deployment

LOOPBACK = "boot-1:4026531840"  # the two nodes' one machine
SPMD = "mallory--spmd"  # the attacker's every_rank gang (app keys: workspace--app)
PLAIN = "mallory--plain"  # the attacker's gang with the default, rank 0 alone
OTHER = "mallory--other"  # another endpoint of the attacker's own workspace
ALICE = "alice--chat"  # another workspace's endpoint
GANG = {"nodes": 2, "gang_ports": 16, "max_replicas": 1}
EVERY_RANK = {**GANG, "gang_inputs": "every_rank"}
KINDS = ("error", "cancelled", "end", "result", "result_part", "event")


def deploy(
    env: Env, app: str, *, kind: str = "function", streaming: bool = False, **settings: Any
) -> str:
    """Apply a manifest as the deploy API would after parsing it: the endpoint's label."""
    spec = EndpointSpec(
        name="fn",
        attribute="fn",
        kind=kind,
        settings=EndpointSettings(**settings),
        methods={FUNCTION_METHOD: MethodSpec(FUNCTION_METHOD, streaming=streaming, is_async=False)},
    )
    manifest = AppManifest(app=app, entry="app.py", endpoints=[spec])
    env.cluster.deployments.apply(Deployment(app, 1, DIGEST, manifest.to_dict(), time.time()))
    return make_label(app, "fn")


def submit(env: Env, label: str, body: bytes = b'{"x": 1}', *, is_async: bool = False) -> Input:
    runtime = env.cluster.endpoints[label]
    inp = Input(
        id=f"in-{len(env.cluster.inputs)}-{time.monotonic_ns()}",
        label=label,
        method=FUNCTION_METHOD,
        body=body,
        streaming=runtime.spec.methods[FUNCTION_METHOD].streaming,
        is_async=is_async,
    )
    env.cluster.input_lifecycle.submit(inp)
    return inp


def second_node(env: Env) -> Worker:
    env.worker.loopback = LOOPBACK
    return env.cluster.register_worker(hello(name="node-b", loopback=LOOPBACK))


def started(env: Env, other: Worker) -> list[Replica]:
    """Tick; the replicas it started (a gang's by rank)."""
    env.tick()
    commands = [c for c in env.commands() + env.commands(other) if c["type"] == "start_replica"]
    commands.sort(key=lambda c: (c.get("gang") or {}).get("rank", 0))
    return [env.cluster.replicas[c["replica_id"]] for c in commands]


def ready_gang(env: Env, other: Worker, *, lazy_member: bool = False) -> tuple[Replica, Replica]:
    """Start the gang a call waits for; (rank 0, rank 1), both ready."""
    lead, member = started(env, other)
    assert lead.gang is not None and member.gang is lead.gang
    if lazy_member:  # restored lazily: its memory still arriving
        env.connect(member)
        start = wire.StartReport(kind="restore", restore_seconds=0.05, memory_pending=True)
        env.cluster.messages.from_replica(member, wire.frame(wire.Ready(start=start)))
    else:
        env.ready(member)
    env.ready(lead)
    return lead, member


def ready_single(env: Env, other: Worker) -> Replica:
    (replica,) = started(env, other)
    env.ready(replica)
    return replica


def say(
    env: Env, replica: Replica, kind: str, input_id: str, body: bytes = b"", **extra: Any
) -> None:
    """A message about input `input_id` from `replica` (any id: the replica's code picks)."""
    fields: dict[str, Any] = {"type": kind, "id": input_id, **extra}
    if kind == "error":
        fields = {"status": 500, "error_type": "ValueError", "message": "pwned", **fields}
    header: wire.FromReplica = msgspec.convert(fields, wire.FromReplica)
    env.cluster.messages.from_replica(replica, wire.frame(header, body))


def worker_of(env: Env, replica: Replica) -> Worker:
    return env.cluster.workers[replica.worker_id]


def cancels(env: Env, replica: Replica) -> list[str]:
    return [h["id"] for h, _ in env.sent(replica) if h["type"] == "cancel"]


# --- 1. a member names calls that are not its gang's ------------------------------------


def test_a_member_cannot_end_or_fail_calls_that_are_not_its_gang_leads(tmp_path: Path) -> None:
    """Mallory's members (of an every_rank gang, and of a default rank-0 gang) send every
    kind of message about alice's running call, mallory's other endpoint's, and (the
    rank-0 gang's member) its own lead's: nothing of it counts; each call is answered
    by its own replica."""

    async def scenario(env: Env) -> None:
        other = second_node(env)
        victims = {}
        for app in (ALICE, OTHER):
            label = deploy(env, app)
            victims[app] = (
                submit(env, label, b'"' + app.encode() + b'"'),
                ready_single(env, other),
            )
        plain = submit(env, deploy(env, PLAIN, **GANG))
        plain_lead, plain_member = ready_gang(env, other)
        spmd = submit(env, deploy(env, SPMD, **EVERY_RANK))
        spmd_lead, spmd_member = ready_gang(env, other)
        assert spmd.id in spmd_lead.inflight and plain.id in plain_lead.inflight

        targets = [inp.id for inp, _ in victims.values()]
        for member, ids in ((spmd_member, targets), (plain_member, [*targets, plain.id])):
            for input_id in ids:
                for kind in KINDS:
                    say(env, member, kind, input_id, b'"forged"' if kind != "cancelled" else b"")

        for inp, replica in victims.values():
            assert not inp.done, f"{inp.label}'s call was ended by another's gang member"
            assert inp.id not in cancels(env, replica)
        assert not plain.done and not spmd.done
        for inp, replica in [*victims.values(), (plain, plain_lead), (spmd, spmd_lead)]:
            say(env, replica, "result", inp.id, b'"own answer"')
            assert outcome_of(inp) == Outcome(200, b'"own answer"')

    run(tmp_path, scenario)


# --- 2. what a member sends about its copy ------------------------------------------------


def test_a_members_flood_and_odd_error_about_its_copy_fail_only_that_call(tmp_path: Path) -> None:
    """About its copy of rank 0's streamed input, a member sends 4 MiB of events and
    result pieces (none kept: nothing held, no event reaches the caller), then an Error
    of 4 MiB with NUL, a lone surrogate and terminal escapes. The call fails with it, as
    JSON; rank 0 is told to cancel, and its slot is free once it says it did. A result
    about a copy is its end: nothing of it is held either."""

    async def scenario(env: Env) -> None:
        other = second_node(env)
        label = deploy(env, SPMD, streaming=True, concurrency=1, **EVERY_RANK)
        first = submit(env, label)
        lead, member = ready_gang(env, other)
        queued = submit(env, label)
        answers = env.cluster.state.answers
        chunk = b'"' + b"x" * (64 * 1024) + b'"'
        for _ in range(32):
            for kind in ("event", "result_part"):
                say(env, member, kind, first.id, chunk)
        assert answers.held == 0 and not first.done and not first.result_parts
        assert first.queued_events() == []

        odd = "\x00\ud800\x1b[2J\r\nHTTP/1.1 200 OK\r\n" + "y" * (4 * MIB)
        say(env, member, "error", first.id, status=599, error_type="E\u2028rr", message=odd)
        outcome = outcome_of(first)
        error = json.loads(outcome.body)["error"]
        assert outcome.status == 599 and error["message"] == f"rank 1 of its gang: {odd}"
        assert first.id in cancels(env, lead) and first.id in cancels(env, member)
        assert queued.id not in lead.inflight  # rank 0's slot: until it says it stopped
        say(env, lead, "cancelled", first.id)
        assert env.inputs_sent(lead) == [queued.id]
        assert env.inputs_sent(member) == [queued.id]
        say(env, member, "result", queued.id, chunk)
        say(env, lead, "end", queued.id)
        assert outcome_of(queued) == Outcome(200, b"")
        assert answers.held == 0

    run(tmp_path, scenario)


# --- 3. a member that reads nothing ---------------------------------------------------------


def test_a_member_that_reads_nothing_does_not_make_the_control_plane_keep_every_copy(
    tmp_path: Path,
) -> None:
    """Rank 1 heartbeats but never reads its channel (its pump then waits on the socket
    for ever: channels have no ping); rank 0 reads and answers each input at once.
    Each input's copy for rank 1 must not pile up in the control plane past what the
    workspace may hold (1 MiB here), long after its call was answered and its body let
    go. (Mended: rank 0 takes no more inputs than its members have room for beside the
    copies they have not ended: the calls wait in the queue instead.)"""

    async def scenario(env: Env) -> None:
        other = second_node(env)
        label = deploy(env, SPMD, concurrency=1, **EVERY_RANK)
        body = b'"' + b"z" * (64 * 1024) + b'"'
        first = submit(env, label, body)
        lead, member = ready_gang(env, other)
        env.sent(lead)  # rank 0 reads
        say(env, lead, "result", first.id, b'"ok"')
        assert outcome_of(first) == Outcome(200, b'"ok"')
        env.cluster.state.release_held(first)  # its caller was answered
        waiting = [submit(env, label, body) for _ in range(48)]  # 3 MiB of bodies in all
        env.cluster.messages.from_replica(member, wire.frame(wire.ReplicaHeartbeat()))
        assert lead.inflight == {} and list(env.cluster.endpoints[label].pending) == waiting
        assert member.outbox is not None
        backlog = sum(len(text) for text in member.outbox._queue)  # type: ignore[attr-defined]
        budget = env.config.workspace_held_mb * MIB
        assert backlog <= budget, (
            f"the control plane holds {backlog / MIB:.1f} MiB of copies for a member that "
            f"reads nothing ({member.outbox.qsize()} messages), past the workspace's "
            f"{budget / MIB:.0f} MiB, while it counts {len(body)} bytes of bodies held"
        )

    run(tmp_path, scenario, workspace_held_mb=1)


# --- 4. rank 0 answers after its member's error ---------------------------------------------


def test_rank_0_answering_after_its_members_error_leaves_nothing_counted_as_held(
    tmp_path: Path,
) -> None:
    """Rank 1 fails each spawned call; rank 0 sends its (400 KiB) result rather than
    `cancelled`, as it would when its step ended just as the cancel came. The calls
    fail with rank 1's error; nothing of theirs may stay counted in the workspace's
    held bytes (a workspace past its budget has its channels read no further)."""

    async def scenario(env: Env) -> None:
        other = second_node(env)
        label = deploy(env, SPMD, concurrency=1, **EVERY_RANK)
        inp = submit(env, label, is_async=True)
        lead, member = ready_gang(env, other)
        result = b'"' + b"r" * (400 * 1024) + b'"'
        for _ in range(3):
            say(env, member, "error", inp.id)
            assert outcome_of(inp).status == 500
            say(env, lead, "result", inp.id, result)  # its slot is free again
            inp = submit(env, label, is_async=True)
            assert inp.id in lead.inflight
        answers = env.cluster.state.answers
        assert answers.of("mallory") == 0, (
            f"{answers.of('mallory')} bytes of ended calls counted as held for good; "
            f"the workspace is full: {answers.full('mallory')}"
        )

    run(tmp_path, scenario, workspace_held_mb=1)


# --- 5. a lazily restored member ----------------------------------------------------------------


def test_a_lazily_restored_members_held_messages_go_through_the_same_checks(
    tmp_path: Path,
) -> None:
    """While its memory arrives, rank 1's messages are held: it sends an Error about
    alice's call and about its lead's, and 3 MiB of events about its lead's. Once its
    memory is in, only the Error about its own lead's call counts; alice's call is
    untouched. What was held meanwhile must stay within the workspace's budget."""

    async def scenario(env: Env) -> None:
        other = second_node(env)
        alice = submit(env, deploy(env, ALICE))
        alice_replica = ready_single(env, other)
        own = submit(env, deploy(env, SPMD, **EVERY_RANK))
        lead, member = ready_gang(env, other, lazy_member=True)
        assert own.id in lead.inflight and member.held == []
        say(env, member, "error", alice.id)
        say(env, member, "error", own.id, message="held")
        chunk = b'"' + b"e" * (64 * 1024) + b'"'
        for _ in range(48):
            say(env, member, "event", own.id, chunk)
        assert not own.done and not alice.done
        answers = env.cluster.state.answers
        held = sum(len(body) for _, body in member.held or [])
        # Counted as held: past its budget, the workspace's channels are read no further.
        assert answers.of("mallory") == held and answers.full("mallory")

        memory_in = wire.ReplicaMemoryIn(replica_id=member.id, seconds=0.4)
        env.say(memory_in, worker_of(env, member))
        assert member.held is None
        assert outcome_of(own) == Outcome.error(500, "ValueError", "rank 1 of its gang: held")
        assert not alice.done and alice.id not in cancels(env, alice_replica)
        say(env, alice_replica, "result", alice.id, b'"alice"')
        assert outcome_of(alice) == Outcome(200, b'"alice"')
        assert answers.of("mallory") == 0  # let go once read

    run(tmp_path, scenario, workspace_held_mb=1)


# --- 6. a manifest that bypasses the decorator --------------------------------------------------


def test_a_hand_made_manifest_cannot_copy_a_web_apps_requests_to_its_members(
    tmp_path: Path,
) -> None:
    """The deploy API parses the manifest (`AppManifest.from_dict`) and the decorator's
    checks do not run: a bad `gang_inputs` is refused there, and a web app (kind asgi)
    with every_rank, refused by the decorator, must not have its requests (a caller's
    headers and body) sent to rank 1 as well."""
    spec = {
        "name": "fn",
        "attribute": "fn",
        "kind": "asgi",
        "settings": {**GANG, "gang_inputs": "all"},
        "methods": [],
    }
    try:
        AppManifest.from_dict({"app": SPMD, "entry": "app.py", "endpoints": [spec]})
    except InvalidError as error:
        assert "gang_inputs='all'" in str(error)
    else:
        raise AssertionError("a hand-made gang_inputs='all' was taken")

    spec["settings"] = EVERY_RANK
    try:
        AppManifest.from_dict({"app": SPMD, "entry": "app.py", "endpoints": [spec]})
    except InvalidError as error:
        assert "drop gang_inputs='every_rank'" in str(error)
    else:
        raise AssertionError(
            "a web app deployed with gang_inputs='every_rank' by a hand-made manifest has "
            "each request copied to its other ranks (the decorator alone refuses it)"
        )
