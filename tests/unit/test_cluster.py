"""The control plane's queue, lease and scaling logic, without any network.

Each test drives a real `Cluster` (SQLite store in tmp_path, real `LogSink`) and calls
`Controller.tick(now)` directly, inside an event loop started with `asyncio.run`. Workers
and replicas are played by the test: commands are read from `worker.outbox` and
`replica.outbox`, answers go in through `worker_message` and `replica_message`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import (
    APP,
    DIGEST,
    ENDPOINT,
    ENTRY,
    LABEL,
    WORKER_HELLO,
    Env,
    deployment,
    error_of,
    hello,
    outcome_of,
    run,
)

from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember.wire import messages as wire
from ember.wire.labels import make_label
from ember.wire.spec import FUNCTION_METHOD, AppManifest, EndpointSpec, MethodSpec
from ember_platform.core.cluster import Cluster
from ember_platform.core.cluster_status import update_gauges
from ember_platform.core.controller import Controller
from ember_platform.core.replicas import STARTUP_FAILURES_BEFORE_GIVING_UP
from ember_platform.core.workers import WorkerNameTaken
from ember_platform.edge.errors import http_error
from ember_platform.errors import DiskFull, QueueFull, UnknownEndpoint
from ember_platform.observability.logs import LogSink
from ember_platform.runtime import live_state
from ember_platform.runtime.cluster_model import Replica, ReplicaState, rollout_status
from ember_platform.runtime.inputs import END, EVENT, Input, InputPhase, Outcome
from ember_platform.security.secrets import env_digest
from ember_platform.snapshots.registry import snapshot_key
from ember_platform.storage.records import CallRecord, CallStatus, Deployment
from ember_platform.storage.sqlite_store import SqliteStateStore

# --- submit, scale up, dispatch, answer ---------------------------------------------------


@pytest.mark.parametrize(
    ("queued", "concurrency", "max_replicas", "expected"),
    [(1, 1, 4, 1), (4, 2, 4, 2), (5, 2, 4, 3), (9, 1, 4, 4), (7, 3, 10, 3), (30, 5, 2, 2)],
)
def test_tick_starts_ceil_queued_over_concurrency_capped(
    tmp_path: Path, queued: int, concurrency: int, max_replicas: int, expected: int
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=concurrency, max_replicas=max_replicas)
        env.cluster.wake.clear()
        inputs = [env.submit() for _ in range(queued)]
        assert env.commands() == []  # submitting starts nothing by itself ...
        assert env.cluster.wake.is_set()  # ... it wakes the controller
        env.tick()
        commands = env.commands()
        assert [c["type"] for c in commands] == ["start_replica"] * expected
        replicas = env.started(commands)
        assert len({r.id for r in replicas}) == expected
        for command, replica in zip(commands, replicas, strict=True):
            assert replica.state is ReplicaState.STARTING
            assert replica.worker_id == env.worker.id
            assert command["token"] == replica.token
            assert command["label"] == LABEL
            assert command["app"] == APP
            assert command["endpoint"] == ENDPOINT
            assert command["version"] == 1
            assert command["bundle_digest"] == DIGEST
            assert command["entry"] == ENTRY
            assert command["attribute"] == "fn"
            assert command["concurrency"] == concurrency
        # Starting replicas count: another tick starts no more.
        env.tick()
        assert env.commands() == []
        assert not any(inp.done for inp in inputs)
        assert len(env.runtime.pending) == queued

    run(tmp_path, scenario)


def test_ready_replica_gets_the_body_verbatim_and_the_result_goes_back_verbatim(
    tmp_path: Path,
) -> None:
    body = '{"text": "héllo ✓",\n  "n": [1, 2.50],   "s": "a\\nb"}'.encode()
    result = '{"answer": "é",\n "n": 2.50 }'.encode()

    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit(body)
        env.tick()
        (replica,) = env.started(env.commands())
        env.connect(replica)
        assert env.sent(replica) == []  # nothing is sent before ready
        env.reply(replica, "ready")
        assert replica.state is ReplicaState.READY
        assert env.sent(replica) == [
            ({"type": "input", "id": inp.id, "method": FUNCTION_METHOD}, body)
        ]
        assert replica.inflight == {inp.id: inp}
        assert replica.idle_since is None
        assert inp.replica_id == replica.id and inp.attempts == 1
        assert not env.runtime.pending
        env.reply(replica, "result", inp, result)
        assert outcome_of(inp) == Outcome(200, result)
        assert replica.inflight == {}
        assert replica.idle_since is not None
        assert inp.id not in env.cluster.inputs
        # A second input goes straight to the idle ready replica, no controller needed.
        second = env.submit(b"{}")
        assert env.inputs_sent(replica) == [second.id]
        assert not env.runtime.pending

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("extra", "status", "error_type"),
    [
        ({"status": 400, "error_type": "invalid_arguments"}, 400, "invalid_arguments"),
        ({"status": 500, "error_type": "ValueError"}, 500, "ValueError"),
        ({"error_type": "KeyError"}, 500, "KeyError"),  # no status: 500
    ],
)
def test_error_reply_becomes_the_outcome(
    tmp_path: Path, extra: dict[str, Any], status: int, error_type: str
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "error", inp, message="it broke", **extra)
        outcome = outcome_of(inp)
        assert outcome.status == status
        assert error_of(outcome) == (error_type, "it broke")
        assert replica.inflight == {}
        assert replica.state is ReplicaState.READY

    run(tmp_path, scenario)


def test_stream_events_then_end(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(streaming=True)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "event", inp, b'{"tok": 1}')
        env.reply(replica, "event", inp, b'"two"')
        assert not inp.done
        env.reply(replica, "end", inp)
        assert outcome_of(inp) == Outcome(200, b"")
        items = inp.queued_events()
        assert items == [(EVENT, b'{"tok": 1}'), (EVENT, b'"two"'), (END, None)]

    run(tmp_path, scenario)


def test_late_output_for_an_unknown_input_is_dropped(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1)
        (replica,) = env.start_ready()
        env.reply(replica, "result", body=b"{}", id="nobody")
        env.reply(replica, "heartbeat")
        assert replica.state is ReplicaState.READY and replica.inflight == {}

    run(tmp_path, scenario)


# --- concurrency and packing --------------------------------------------------------------


def test_third_input_waits_for_a_free_slot(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2, max_replicas=1)
        a, b, c = env.submit(b'{"n": 1}'), env.submit(b'{"n": 2}'), env.submit(b'{"n": 3}')
        env.tick()
        (replica,) = env.started(env.commands())  # max_replicas=1
        env.ready(replica)
        assert env.inputs_sent(replica) == [a.id, b.id]
        assert list(env.runtime.pending) == [c]
        env.tick()
        assert env.commands() == []  # capped at one replica: c waits
        env.reply(replica, "result", b, b"2")
        assert outcome_of(b) == Outcome(200, b"2")
        assert env.inputs_sent(replica) == [c.id]
        assert set(replica.inflight) == {a.id, c.id}
        assert not env.runtime.pending

    run(tmp_path, scenario)


def test_dispatch_packs_inputs_onto_the_busier_replica(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=3, max_replicas=2)
        first = [env.submit() for _ in range(4)]
        env.tick()
        one, two = env.started(env.commands())
        env.ready(one)
        assert len(one.inflight) == 3  # filled up before anything else
        env.ready(two)
        assert len(two.inflight) == 1
        assert env.inputs_sent(one) == [i.id for i in first[:3]]
        assert env.inputs_sent(two) == [first[3].id]
        env.reply(one, "result", first[0], b"0")
        assert len(one.inflight) == 2
        # 2 in flight on `one` and 1 on `two`: the new input goes to the busier one.
        packed = env.submit()
        assert packed.replica_id == one.id
        assert (len(one.inflight), len(two.inflight)) == (3, 1)
        # `one` is full: the next ones go to `two`, then queue.
        overflow = [env.submit() for _ in range(3)]
        assert [i.replica_id for i in overflow] == [two.id, two.id, None]
        assert list(env.runtime.pending) == [overflow[2]]

    run(tmp_path, scenario)


def test_target_concurrency_sizes_the_replicas_and_a_burst_overflows_onto_the_least_busy(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=4, target_concurrency=2, max_replicas=3)
        burst = [env.submit() for _ in range(6)]
        env.tick()
        one, two, three = env.started(env.commands())  # 6 inputs at 2 each, not 4 each
        env.ready(one)
        assert len(one.inflight) == 4  # the first one ready takes up to its concurrency
        env.ready(two)
        assert len(two.inflight) == 2
        env.ready(three)
        assert len(three.inflight) == 0  # nothing left for it
        for inp in burst[:3]:  # `one` is down to 1, below the target
            if inp.replica_id == one.id:
                env.reply(one, "result", inp, b"0")
        assert len(one.inflight) == 1
        # Below the target, the busiest takes it (`one`, 1 in flight, over idle `three`);
        # then `three`, the only one below the target; then past the target, the least
        # busy with room.
        placed = [env.submit() for _ in range(3)]
        assert [i.replica_id for i in placed] == [one.id, three.id, three.id]
        spill = [env.submit() for _ in range(2)]
        assert [i.replica_id for i in spill] == [one.id, two.id]

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"concurrency": 2, "target_concurrency": 3}, "target_concurrency=3 is above"),
        ({"target_concurrency": 0}, "target_concurrency=0 is out of range"),
        ({"target_concurrency": 1.5}, "target_concurrency must be a whole number"),
    ],
)
def test_target_concurrency_is_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        EndpointSettings(**settings)


def test_queue_timeout_sheds_a_waiting_call_but_not_a_spawned_or_dispatched_one(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, min_replicas=1, queue_timeout=0.1)
        (replica,) = env.start_ready()
        running = env.submit()
        assert running.replica_id == replica.id
        waiting, spawned = env.submit(), env.submit(is_async=True)
        await asyncio.wait_for(asyncio.shield(waiting.outcome), 5)
        assert outcome_of(waiting).status == 504
        kind, message = error_of(outcome_of(waiting))
        assert kind == "queue_timeout" and "within queue_timeout=0.1 s" in message
        await asyncio.sleep(0.2)  # past any timer the spawned call could have had
        assert not spawned.done and list(env.runtime.pending) == [spawned]
        assert not running.done  # dispatched: its run is bounded by timeout=, not this
        # One that gets a replica in time runs, however long it then takes.
        env.reply(replica, "result", running, b"1")
        lucky = env.submit()
        env.reply(replica, "result", spawned, b"2")
        assert lucky.replica_id == replica.id
        await asyncio.sleep(0.3)
        assert not lucky.done

    run(tmp_path, scenario)


def test_the_queue_is_served_highest_priority_first_and_in_arrival_order_within_one(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, min_replicas=1)
        (replica,) = env.start_ready()
        running = env.submit()
        arrivals = [("low", 2), ("normal", 1), ("high", 0), ("normal", 1), ("high", 0)]
        queued = [
            (f"{name}-{n}", env.submit(priority=rank)) for n, (name, rank) in enumerate(arrivals)
        ]
        order = [next(n for n, i in queued if i is inp) for inp in env.runtime.pending]
        assert order == ["high-2", "high-4", "normal-1", "normal-3", "low-0"]
        env.reply(replica, "result", running, b"1")
        assert env.inputs_sent(replica)[-1] == queued[2][1].id

    run(tmp_path, scenario)


def test_an_endpoints_own_max_queue_turns_callers_away_first(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, max_queue=2)
        env.submit(), env.submit()
        with pytest.raises(QueueFull) as caught:
            env.submit()
        assert http_error(caught.value).status == 429

    run(tmp_path, scenario)


def test_a_replica_retires_after_max_inputs_and_a_fresh_one_takes_the_next(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=2, concurrency=2, max_inputs=2)
        a, b = env.submit(), env.submit()
        (first,) = env.start_ready()
        # It took two, its max_inputs: the third waits for another replica, not for it.
        assert env.inputs_sent(first) == [a.id, b.id]
        assert first.state is ReplicaState.DRAINING
        c = env.submit()
        assert list(env.runtime.pending) == [c]
        (second,) = env.start_ready()
        assert env.inputs_sent(second) == [c.id]
        assert second.state is ReplicaState.READY  # one of its two so far
        env.reply(first, "result", a, b"1")
        assert env.commands() == []  # it still runs b
        env.reply(first, "result", b, b"2")
        assert env.commands() == [{"type": "stop_replica", "replica_id": first.id, "grace": 30.0}]
        assert (outcome_of(a), outcome_of(b)) == (Outcome(200, b"1"), Outcome(200, b"2"))
        # The new one's second input is its last.
        d = env.submit()
        assert env.inputs_sent(second) == [d.id]
        assert second.state is ReplicaState.DRAINING
        assert "took its max_inputs=2" in env.logs()

    run(tmp_path, scenario)


def test_replicas_retiring_after_max_inputs_still_count_against_max_replicas(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        # One input at a time, each on a fresh replica: never two running at once.
        env.deploy(max_replicas=1, concurrency=1, max_inputs=1)
        a, b = env.submit(), env.submit()
        (first,) = env.start_ready()
        assert env.inputs_sent(first) == [a.id] and first.state is ReplicaState.DRAINING
        env.tick()
        assert env.started(env.commands()) == []  # b waits: first still runs a
        env.reply(first, "result", a, b"1")
        env.exited(first, returncode=0)
        (second,) = env.start_ready()
        assert env.inputs_sent(second) == [b.id]

    run(tmp_path, scenario)


def test_inputs_queued_for_a_method_a_redeploy_removed_get_a_404(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        waiting = env.submit()  # no replica yet: it waits in the queue
        spec = EndpointSpec(
            name=ENDPOINT,
            attribute="Model",
            kind="class",
            settings=EndpointSettings(max_replicas=1),
            methods={"other": MethodSpec("other", streaming=False, is_async=False)},
        )
        manifest = AppManifest(app=APP, entry=ENTRY, endpoints=[spec])
        env.cluster.deployments.apply(Deployment(APP, 2, DIGEST, manifest.to_dict(), time.time()))
        outcome = outcome_of(waiting)
        assert outcome.status == 404 and not env.runtime.pending
        assert "has no method '__call__' (it has: other)" in error_of(outcome)[1]

    run(tmp_path, scenario)


def test_max_inputs_must_be_a_positive_count() -> None:
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(InvalidError, match="max_inputs"):
            EndpointSettings(max_inputs=bad)  # type: ignore[arg-type]


# --- lost replicas and retries ------------------------------------------------------------


def lose(env: Env, replica: Replica, how: str) -> None:
    if how == "replica_exited":
        env.exited(replica, returncode=-9)
    else:
        env.cluster.messages.replica_disconnected(replica)


@pytest.mark.parametrize("how", ["replica_exited", "replica_disconnected"])
def test_lost_replica_requeues_its_input_at_the_front(tmp_path: Path, how: str) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=2)
        a, b = env.submit(b'{"a": 1}'), env.submit(b'{"b": 2}')
        (first,) = env.start_ready()
        assert env.inputs_sent(first) == [a.id]
        assert list(env.runtime.pending) == [b]
        lose(env, first, how)
        assert first.id not in env.cluster.replicas
        assert first.id not in env.runtime.replicas
        assert {"type": "kill_replica", "replica_id": first.id} in env.commands()
        assert not a.done and a.replica_id is None and a.attempts == 1
        assert list(env.runtime.pending) == [a, b]  # the lost input goes first
        assert env.cluster.wake.is_set()
        assert f"input {a.id} requeued" in env.logs()
        (second,) = env.start_ready()
        sent = env.sent(second)
        assert sent == [({"type": "input", "id": a.id, "method": FUNCTION_METHOD}, b'{"a": 1}')]
        assert a.attempts == 2
        env.reply(second, "result", a, b'"ok"')
        assert outcome_of(a) == Outcome(200, b'"ok"')
        assert env.inputs_sent(second) == [b.id]
        env.reply(second, "result", b, b'"ok too"')
        assert outcome_of(b) == Outcome(200, b'"ok too"')

    run(tmp_path, scenario)


def test_a_closed_channel_waits_for_its_worker_to_say_how_the_process_ended(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=0, concurrency=2)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.sent(replica)
        env.cluster.messages.replica_disconnected(replica)
        assert env.cluster.replicas[replica.id] is replica and not inp.done
        later = env.submit()  # not for a replica whose channel closed
        assert list(env.runtime.pending) == [later] and later.replica_id is None
        oom = "killed by the kernel's OOM killer (SIGKILL): memory ran out while it ran"
        env.say(wire.ReplicaExited(replica_id=replica.id, returncode=-9, detail=oom))
        assert replica.id not in env.cluster.replicas
        outcome = outcome_of(inp)
        assert outcome.status == 502
        error_type, message = error_of(outcome)
        assert error_type == "replica_lost" and oom in message
        assert f"replica lost: its process ended ({oom})" in env.logs()
        await asyncio.sleep(0.3)  # past the grace: nothing more happens to it
        assert "connection to the control plane closed" not in env.logs()

    run(tmp_path, scenario, exit_report_grace_seconds=0.2)


def test_a_closed_channel_no_worker_explains_is_lost_after_the_grace(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=0)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.cluster.messages.replica_disconnected(replica)
        assert not inp.done
        await asyncio.sleep(0.15)
        assert replica.id not in env.cluster.replicas
        assert {"type": "kill_replica", "replica_id": replica.id} in env.commands()
        error_type, message = error_of(outcome_of(inp))
        assert error_type == "replica_lost"
        assert "its connection to the control plane closed" in message

    run(tmp_path, scenario, exit_report_grace_seconds=0.05)


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_input_fails_502_after_retries_are_used_up(tmp_path: Path, retries: int) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=retries)
        inp = env.submit()
        last: Replica | None = None
        for attempt in range(1, retries + 2):
            (last,) = env.start_ready()
            assert env.inputs_sent(last) == [inp.id]
            assert inp.attempts == attempt
            assert not inp.done
            env.exited(last)
        assert last is not None
        outcome = outcome_of(inp)
        assert outcome.status == 502
        error_type, message = error_of(outcome)
        assert error_type == "replica_lost"
        assert f"gave up after {retries + 1} attempts (retries={retries})" in message
        assert last.id in message
        assert not env.runtime.pending
        env.tick()
        assert env.started(env.commands()) == []  # nothing left to serve

    run(tmp_path, scenario)


def test_an_input_that_crashes_its_replica_fails_by_its_own_retries_not_its_neighbours(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=1, concurrency=4)
        poison, *neighbours = [env.submit(f'{{"n": {n}}}'.encode()) for n in range(4)]
        (first,) = env.start_ready()
        assert env.inputs_sent(first) == [poison.id, *(n.id for n in neighbours)]
        env.exited(first)  # one of the four did it; which, nobody knows
        assert all(
            inp.suspect and not inp.done and inp.attempts == 0 for inp in [poison, *neighbours]
        )
        # Each runs again alone, on a replica with nothing else in flight.
        (second,) = env.start_ready()
        assert env.inputs_sent(second) == [poison.id] and poison.attempts == 1
        env.exited(second)  # alone, so it is charged: its one retry is spent now
        (third,) = env.start_ready()
        assert env.inputs_sent(third) == [poison.id] and poison.attempts == 2
        later = env.submit(b'{"later": 1}')
        env.exited(third)
        error_type, message = error_of(outcome_of(poison))
        assert error_type == "replica_lost" and "gave up after 2 attempts (retries=1)" in message
        (fourth,) = env.start_ready()
        for inp in neighbours:  # one by one, and none is charged for the crashes
            assert env.inputs_sent(fourth) == [inp.id] and inp.attempts == 1
            env.reply(fourth, "result", inp, b'"ok"')
            assert outcome_of(inp) == Outcome(200, b'"ok"')
        assert env.inputs_sent(fourth) == [later.id]
        # Inputs that were never suspected share a replica as before.
        more = [env.submit() for _ in range(2)]
        assert env.inputs_sent(fourth) == [inp.id for inp in more]

    run(tmp_path, scenario)


def test_stream_that_emitted_is_not_retried(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(streaming=True, retries=2, concurrency=2, max_replicas=1)
        emitted, silent = env.submit(), env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "event", emitted, b'{"tok": 1}')
        env.cluster.messages.replica_disconnected(replica)
        outcome = outcome_of(emitted)
        assert outcome.status == 502
        error_type, message = error_of(outcome)
        assert error_type == "replica_lost"
        assert "interrupted" in message
        items = emitted.queued_events()
        assert items == [(EVENT, b'{"tok": 1}'), ("error", outcome.body)]
        # The stream that had sent nothing yet is retried.
        assert not silent.done
        assert list(env.runtime.pending) == [silent]

    run(tmp_path, scenario)


# --- lazily restored replicas -------------------------------------------------------------


def ready_lazily(env: Env, replica: Replica) -> None:
    """`ready` from a replica restored lazily: its memory still arriving."""
    env.connect(replica)
    start = {"kind": "restore", "restore_seconds": 0.05, "memory_pending": True}
    env.cluster.messages.from_replica(replica, wire.frame(wire.Ready(start=start)))


def lazily_restored(env: Env) -> tuple[Input, Replica]:
    """A streaming input, and the replica started for it, ready while its memory
    arrives."""
    env.deploy(streaming=True)
    inp = env.submit()
    env.tick()
    (replica,) = env.started(env.commands())
    ready_lazily(env, replica)
    return inp, replica


def memory_in(env: Env, replica: Replica, error: str | None = None) -> None:
    env.say(wire.ReplicaMemoryIn(replica_id=replica.id, seconds=0.4, error=error))


def test_what_a_lazily_restored_replica_says_early_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held until its memory is in, counted in its workspace's answers; past the bound
    (a result's worth; 1 MiB here) it is lost and its input runs on another."""
    monkeypatch.setattr(live_state, "MAX_HELD_MIB", 1)

    async def scenario(env: Env) -> None:
        inp, replica = lazily_restored(env)
        env.inputs_sent(replica)
        env.reply(replica, "event", inp, b'"' + b"e" * 600_000 + b'"')
        assert env.cluster.state.answers.held == 600_002
        env.reply(replica, "event", inp, b'"' + b"e" * 600_000 + b'"')
        assert replica.id not in env.cluster.replicas and not inp.done
        assert env.cluster.state.answers.held == 0  # let go with it
        assert "before its memory was in" in env.logs()

    run(tmp_path, scenario)


def test_lazily_restored_replica_answers_count_once_its_memory_is_in(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        inp, replica = lazily_restored(env)
        assert env.inputs_sent(replica) == [inp.id]  # it works while its memory arrives
        env.reply(replica, "event", inp, b'{"n": 0}')
        env.reply(replica, "end", inp)
        assert not inp.emitted and inp.events.empty() and not inp.done
        memory_in(env, replica)
        assert inp.emitted and inp.queued_events() == [(EVENT, b'{"n": 0}'), (END, None)]
        assert outcome_of(inp) == Outcome(200, b"")
        assert replica.start["memory_in_seconds"] == 0.4
        # From then on, nothing is held.
        second = env.submit()
        assert env.inputs_sent(replica) == [second.id]
        env.reply(replica, "end", second)
        assert outcome_of(second) == Outcome(200, b"")

    run(tmp_path, scenario)


@pytest.mark.parametrize("how", ["replica_exited", "replica_disconnected"])
def test_lazily_restored_replica_lost_before_its_memory_is_in_has_its_answers_dropped(
    tmp_path: Path, how: str
) -> None:
    """CRIU's page daemon failed: the agent kills the replica. What it answered may have
    been computed over zeroed pages, so the input runs again elsewhere."""

    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, retries=1)
        inp = env.submit()
        env.tick()
        (first,) = env.started(env.commands())
        ready_lazily(env, first)
        env.reply(first, "result", inp, b'"computed over zeroed pages"')
        memory_in(env, first, error="lazy-pages exited with status 1")
        assert not inp.done
        lose(env, first, how)
        assert not inp.done and list(env.runtime.pending) == [inp]
        (second,) = env.start_ready()
        assert env.inputs_sent(second) == [inp.id]
        env.reply(second, "result", inp, b'"right"')
        assert outcome_of(inp) == Outcome(200, b'"right"')

    run(tmp_path, scenario)


def test_memory_in_before_ready_holds_nothing(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        env.tick()
        (replica,) = env.started(env.commands())
        memory_in(env, replica)
        ready_lazily(env, replica)
        assert env.inputs_sent(replica) == [inp.id]
        env.reply(replica, "result", inp, b'"ok"')
        assert outcome_of(inp) == Outcome(200, b'"ok"')

    run(tmp_path, scenario)


# --- timeouts -----------------------------------------------------------------------------


def test_timeout_504_replaces_the_replica_without_charging_the_others(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        # retries=0: charging the innocent input an attempt would fail it with 502.
        env.deploy(concurrency=2, max_replicas=1, retries=0, timeout=0.05)
        slow = env.submit()
        (replica,) = env.start_ready()
        await asyncio.sleep(0.01)
        other = env.submit()  # its own deadline comes later than slow's
        assert env.inputs_sent(replica) == [slow.id, other.id]
        await asyncio.sleep(0.1)
        outcome = outcome_of(slow)
        assert outcome.status == 504
        assert error_of(outcome) == (
            "timeout",
            f"{LABEL} ran longer than its timeout of 0.05 s",
        )
        assert {"type": "kill_replica", "replica_id": replica.id} in env.commands()
        assert replica.id not in env.cluster.replicas
        assert not other.done
        assert other.attempts == 0
        assert list(env.runtime.pending) == [other]
        (fresh,) = env.start_ready()
        assert env.inputs_sent(fresh) == [other.id]
        assert other.attempts == 1
        env.reply(fresh, "result", other, b"1")
        assert outcome_of(other) == Outcome(200, b"1")

    run(tmp_path, scenario)


def test_an_async_input_past_its_timeout_is_cancelled_and_its_replica_serves_on(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2, max_replicas=1, retries=0, timeout=0.5, is_async=True)
        slow = env.submit()
        (replica,) = env.start_ready()
        await asyncio.sleep(0.25)
        other = env.submit()
        assert env.inputs_sent(replica) == [slow.id, other.id]
        await asyncio.sleep(0.35)  # past slow's timeout, not other's
        assert outcome_of(slow).status == 504
        # Stopped where it waits, not by replacing the replica: the other input runs on.
        assert ({"type": "cancel", "id": slow.id}, b"") in env.sent(replica)
        assert replica.id in env.cluster.replicas and not other.done
        env.reply(replica, "cancelled", slow)
        env.reply(replica, "result", other, b"1")
        assert outcome_of(other) == Outcome(200, b"1")
        assert not env.commands()  # nothing killed

    run(tmp_path, scenario)


def test_result_in_time_cancels_the_timer(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(timeout=0.05, max_replicas=1)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "result", inp, b"1")
        await asyncio.sleep(0.08)
        assert outcome_of(inp) == Outcome(200, b"1")
        assert replica.id in env.cluster.replicas
        assert env.commands() == []

    run(tmp_path, scenario)


# --- cancellation -------------------------------------------------------------------------


def test_cancel_running_input_keeps_the_slot_until_cancelled(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=1, max_replicas=1)
        a, b = env.submit(), env.submit()
        (replica,) = env.start_ready()
        assert env.inputs_sent(replica) == [a.id]
        assert a.phase is InputPhase.RUNNING and b.phase is None  # a's lease; b, no timeout
        env.cluster.input_lifecycle.cancel(a, "the caller went away")
        assert a.phase is InputPhase.CANCELLING  # the time its replica has to stop it
        outcome = outcome_of(a)
        assert outcome.status == 499
        assert error_of(outcome) == ("cancelled", "the caller went away")
        assert env.sent(replica) == [({"type": "cancel", "id": a.id}, b"")]
        assert a.id in replica.inflight  # the slot is still taken
        assert list(env.runtime.pending) == [b]
        env.tick()
        assert env.commands() == []  # max_replicas=1: b waits for the slot
        env.reply(replica, "cancelled", a)
        assert a.timer is None and a.phase is None  # its cancel wait is over
        assert env.inputs_sent(replica) == [b.id]
        assert outcome_of(a).status == 499  # unchanged
        # Cancelling again, or after it finished, is a no-op.
        env.cluster.input_lifecycle.cancel(a, "again")
        assert env.sent(replica) == []

    run(tmp_path, scenario)


def test_cancel_then_late_result_frees_the_slot_and_keeps_499(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=1, max_replicas=1)
        a, b = env.submit(), env.submit()
        (replica,) = env.start_ready()
        env.cluster.input_lifecycle.cancel(a, "gone")
        env.reply(replica, "result", a, b'"too late"')
        assert outcome_of(a).status == 499
        assert b.replica_id == replica.id

    run(tmp_path, scenario)


def test_cancel_queued_input_just_drops_it(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=1, max_replicas=1)
        a, b = env.submit(), env.submit()
        (replica,) = env.start_ready()
        env.sent(replica)
        env.cluster.input_lifecycle.cancel(b, "gone")
        assert outcome_of(b).status == 499
        assert not env.runtime.pending
        assert env.sent(replica) == []
        assert b.id not in env.cluster.inputs
        env.reply(replica, "result", a, b"1")
        assert env.sent(replica) == []  # nothing left to send

    run(tmp_path, scenario)


def test_cancel_not_acknowledged_within_timeout_replaces_the_replica(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=1, max_replicas=1, timeout=0.05)
        a = env.submit()
        (replica,) = env.start_ready()
        env.cluster.input_lifecycle.cancel(a, "gone")
        b = env.submit()
        assert list(env.runtime.pending) == [b]
        await asyncio.sleep(0.1)
        assert {"type": "kill_replica", "replica_id": replica.id} in env.commands()
        assert replica.id not in env.cluster.replicas
        assert outcome_of(a).status == 499
        assert not b.done and list(env.runtime.pending) == [b]
        (fresh,) = env.start_ready()
        assert env.inputs_sent(fresh) == [b.id]

    run(tmp_path, scenario)


def test_cancel_overdue_does_not_charge_the_other_inputs(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2, max_replicas=1, retries=0, timeout=0.05)
        stuck = env.submit()
        (replica,) = env.start_ready()
        env.cluster.input_lifecycle.cancel(stuck, "gone")
        await asyncio.sleep(0.02)
        innocent = env.submit()  # its own deadline is after the cancel's
        assert innocent.replica_id == replica.id
        await asyncio.sleep(0.045)  # past the cancel's deadline, before innocent's
        assert replica.id not in env.cluster.replicas
        assert not innocent.done, outcome_of(innocent)
        assert list(env.runtime.pending) == [innocent]

    run(tmp_path, scenario)


# --- scaling down -------------------------------------------------------------------------


def test_idle_replica_stops_only_after_the_scaledown_window(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(scaledown_window=10.0)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "result", inp, b"1")
        t0 = time.time()
        replica.idle_since = t0
        env.advance(t0 + 5.0)
        env.advance(t0 + 9.9)
        assert env.commands() == []
        assert replica.state is ReplicaState.READY
        env.advance(t0 + 10.5)
        assert env.commands() == [{"type": "stop_replica", "replica_id": replica.id, "grace": 30.0}]
        assert replica.state is ReplicaState.STOPPING
        # Its process exits, as the agent reports after the exit hooks ran.
        env.exited(replica, returncode=0)
        assert env.commands() == []  # an orderly exit needs no kill
        assert replica.id not in env.cluster.replicas
        assert env.runtime.replicas == {}  # scaled to zero
        env.advance(t0 + 1000.0)
        assert env.commands() == []  # and stays there

    run(tmp_path, scenario)


def test_stopping_replica_disconnect_is_orderly(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(scaledown_window=1.0)
        env.submit()
        (replica,) = env.start_ready()
        (inp,) = replica.inflight.values()
        env.reply(replica, "result", inp, b"1")
        assert replica.idle_since is not None
        env.advance(replica.idle_since + 2.0)
        assert replica.state is ReplicaState.STOPPING
        env.commands()
        env.cluster.messages.replica_disconnected(replica)
        assert env.commands() == []  # no kill for a replica that stopped as told
        # Its process may still be exiting: it holds its share of the node until the
        # worker says the process is gone.
        assert env.cluster.replicas[replica.id].state is ReplicaState.STOPPING
        (node,) = env.cluster.state.capacities()
        assert node.cpu_used > 0
        env.say(wire.ReplicaExited(replica_id=replica.id, returncode=0))
        assert replica.id not in env.cluster.replicas
        (node,) = env.cluster.state.capacities()
        assert node.cpu_used == 0
        assert env.commands() == []

    run(tmp_path, scenario)


def test_only_replicas_idle_past_the_window_are_stopped(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(scaledown_window=10.0, concurrency=1)
        inputs = [env.submit() for _ in range(3)]
        old, recent, busy = env.start_ready()
        for replica in (old, recent):
            (inp,) = replica.inflight.values()
            env.reply(replica, "result", inp, b"1")
        t0 = time.time()
        old.idle_since = t0 - 100.0
        recent.idle_since = t0 - 1.0
        env.advance(t0)
        assert env.commands() == [{"type": "stop_replica", "replica_id": old.id, "grace": 30.0}]
        assert recent.state is ReplicaState.READY
        assert busy.state is ReplicaState.READY
        # A busy replica is never scaled down, however long ago it started.
        env.advance(t0 + 1000.0)
        assert env.commands() == [{"type": "stop_replica", "replica_id": recent.id, "grace": 30.0}]
        assert busy.state is ReplicaState.READY
        assert not inputs[2].done

    run(tmp_path, scenario)


@pytest.mark.parametrize("min_replicas", [1, 2])
def test_min_replicas_are_started_and_kept(tmp_path: Path, min_replicas: int) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=min_replicas, scaledown_window=1.0)
        replicas = env.start_ready()  # no input at all
        assert len(replicas) == min_replicas
        t0 = time.time()
        for replica in replicas:
            replica.idle_since = t0 - 1000.0
        env.advance(t0)
        env.advance(t0 + 1000.0)
        assert env.commands() == []
        assert all(r.state is ReplicaState.READY for r in replicas)

    run(tmp_path, scenario)


# --- redeploy and removal -----------------------------------------------------------------


def test_a_redeploy_keeps_the_old_replica_serving_until_the_new_one_is_ready(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2)
        old_input = env.submit()
        (old,) = env.start_ready()
        assert old.inflight == {old_input.id: old_input}
        env.deploy(version=2, concurrency=2)
        assert env.runtime.version == 2
        # No replica of version 2 yet: the old one, with a free slot, takes it.
        meanwhile = env.submit()
        assert meanwhile.replica_id == old.id
        env.tick()
        commands = env.commands()
        assert [(c["type"], c["version"]) for c in commands] == [("start_replica", 2)]
        assert old.state is ReplicaState.READY  # serving while the new one starts
        assert rollout_status(env.runtime) == {"ready": 0, "starting": 1, "previous": 1}
        (new,) = env.started(commands)
        env.ready(new)
        after = env.submit()
        assert after.replica_id == new.id  # the new version's, once it is ready
        # Three inputs at two a replica: the new version needs a second replica before
        # the old one, busy with two, may go.
        env.tick()
        (second,) = env.started(env.commands())
        assert old.state is ReplicaState.READY
        env.ready(second)
        env.tick()
        assert old.state is ReplicaState.DRAINING
        assert env.commands() == []
        env.reply(old, "result", old_input, b'"v1"')
        env.reply(old, "result", meanwhile, b'"v1"')
        assert outcome_of(meanwhile) == Outcome(200, b'"v1"')
        assert env.commands() == [{"type": "stop_replica", "replica_id": old.id, "grace": 30.0}]
        env.reply(new, "result", after, b'"v2"')
        assert outcome_of(after) == Outcome(200, b'"v2"')

    run(tmp_path, scenario)


def test_an_idle_old_replica_stops_once_the_new_one_is_ready_or_at_once_without_work(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1)
        (old,) = env.start_ready()
        env.deploy(version=2, min_replicas=1)
        env.tick()
        (new,) = env.started(env.commands())
        assert old.state is ReplicaState.READY
        env.ready(new)
        env.tick()
        assert env.commands() == [{"type": "stop_replica", "replica_id": old.id, "grace": 30.0}]
        # With no work and no min_replicas, nothing of the new version starts: the old
        # replicas go at once.
        env.deploy(version=3)
        env.tick()
        assert env.commands() == [{"type": "stop_replica", "replica_id": new.id, "grace": 30.0}]

    run(tmp_path, scenario)


def test_an_old_replica_holding_the_room_the_new_one_needs_goes_at_once(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1, memory=6000)  # the worker has room for one
        (old,) = env.start_ready()
        env.deploy(version=2, min_replicas=1, memory=6000)
        env.tick()
        assert env.commands() == [{"type": "stop_replica", "replica_id": old.id, "grace": 30.0}]
        env.exited(old, returncode=0)
        env.tick()
        assert [c["version"] for c in env.commands() if c["type"] == "start_replica"] == [2]

    run(tmp_path, scenario)


def test_a_broken_redeploy_leaves_the_old_version_serving(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1, concurrency=2)
        (old,) = env.start_ready()
        env.deploy(version=2, min_replicas=1, concurrency=2)
        env.tick()
        (broken,) = env.started(env.commands())
        env.connect(broken)
        env.reply(broken, "startup_failed", error_type="ImportError", message="no module x")
        assert env.runtime.startup_failures == 1
        env.tick()  # in its backoff: nothing of version 2 is starting
        assert old.state is ReplicaState.READY
        served = env.submit()
        assert served.replica_id == old.id

    run(tmp_path, scenario)


def test_a_broken_redeploy_of_a_scale_to_zero_endpoint_keeps_an_old_replica_serving(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(scaledown_window=30)
        first = env.submit()
        (old,) = env.start_ready()
        env.inputs_sent(old)
        env.reply(old, "result", first, b"{}")
        began = time.time()
        env.deploy(version=2, scaledown_window=30)
        waiting = env.submit()
        env.advance(began)
        (broken,) = env.started(env.commands())
        env.connect(broken)
        env.reply(broken, "startup_failed", error_type="ImportError", message="no module x")
        assert waiting.replica_id == old.id  # served by the old version instead
        env.reply(old, "result", waiting, b"{}")
        # Nothing in flight: the old replica still serves the next call, as if its own
        # version were deployed; past its scale-down window too, being the last one
        # (gone, it could not come back: only the broken version starts).
        env.advance(began + 20)
        assert old.state is ReplicaState.READY
        third = env.submit()
        assert third.replica_id == old.id
        env.reply(old, "result", third, b"{}")
        env.advance(time.time() + 31)
        assert old.state is ReplicaState.READY
        assert env.submit().replica_id == old.id

    run(tmp_path, scenario)


def test_a_recreate_rollout_drains_the_old_version_at_once_and_calls_wait(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2, rollout="recreate")
        old_input = env.submit()
        (old,) = env.start_ready()
        env.deploy(version=2, concurrency=2, rollout="recreate")
        waiting = env.submit()
        assert waiting.replica_id is None  # the old replica has room, but not for it
        env.tick()
        assert [(c["type"], c["version"]) for c in env.commands()] == [("start_replica", 2)]
        assert old.state is ReplicaState.DRAINING
        env.reply(old, "result", old_input, b'"v1"')
        assert outcome_of(old_input) == Outcome(200, b'"v1"')

    run(tmp_path, scenario)


def test_an_input_whose_method_changed_waits_for_the_new_version(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2)
        first = env.submit()
        (old,) = env.start_ready()
        env.deploy(version=2, streaming=True, concurrency=2)  # the method now streams
        changed = env.submit()
        assert changed.replica_id is None and list(env.runtime.pending) == [changed]
        assert old.inflight == {first.id: first}

    run(tmp_path, scenario)


def test_redeploy_while_old_replicas_start_does_not_count_startup_failures(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=3)
        inputs = [env.submit() for _ in range(3)]
        env.tick()
        assert len(env.started(env.commands())) == 3
        env.deploy(version=2, max_replicas=3)
        env.tick()
        commands = env.commands()
        assert [c["type"] for c in commands].count("kill_replica") == 3
        assert not any(inp.done for inp in inputs), [outcome_of(i) for i in inputs if i.done]
        assert env.runtime.startup_failures == 0
        assert [c["version"] for c in commands if c["type"] == "start_replica"] == [2, 2, 2]

    run(tmp_path, scenario)


def test_worker_gone_while_replicas_start_does_not_fail_the_queue(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=3)
        inputs = [env.submit() for _ in range(3)]
        env.tick()
        assert len(env.started(env.commands())) == 3  # all on the only worker
        spare = env.cluster.register_worker(hello(name="node-2"))
        env.cluster.roster.gone(env.worker, "disconnected")
        assert not any(inp.done for inp in inputs), [outcome_of(i) for i in inputs if i.done]
        env.tick()
        assert len(env.started(env.commands(spare))) == 3

    run(tmp_path, scenario)


def test_min_replicas_go_to_different_workers(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        other = env.cluster.register_worker(hello(name="node-2"))
        env.worker.bundles.add(DIGEST)  # the first node holds the bundle already
        env.deploy(min_replicas=2)
        env.tick()
        here, there = env.commands(), env.commands(other)
        assert [c["type"] for c in here] == ["start_replica"]
        assert [c["type"] for c in there] == ["start_replica"]

    run(tmp_path, scenario)


def test_a_replica_starts_where_its_snapshot_image_is_cached_and_restores_from_it(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        snapshots = {"env_key": "env-1"}
        roomy = env.cluster.register_worker(hello(snapshots=snapshots, name="roomy", cpu=16))
        holder = env.cluster.register_worker(hello(snapshots=snapshots, name="holder"))
        env.deploy()
        runtime = env.runtime
        key = snapshot_key(
            runtime, "env-1", env_digest(env.cluster.replica_lifecycle.replica_env(runtime))
        )
        published = wire.SnapshotTaken(
            key=key, replica_id="r-1", image_id="img1", label=LABEL, bundle_digest=DIGEST
        )
        env.cluster.snapshots.taken(roomy, published)  # taken there, and dropped from its cache
        env.say(wire.AgentHeartbeat(cached_snapshots=[[key, "img1"]]), holder)
        env.submit()
        env.tick()
        assert env.started(env.commands(roomy)) == []  # more CPU free, but a download first
        (command,) = [c for c in env.commands(holder) if c["type"] == "start_replica"]
        assert command["snapshot"] == {"action": "restore", "key": key, "image_id": "img1"}

    run(tmp_path, scenario, with_worker=False)


def test_a_replica_boots_where_its_weights_are_cached(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        roomy = env.cluster.register_worker(hello(name="roomy", cpu=16))
        holder = env.cluster.register_worker(hello(name="holder"))
        env.deploy(snapshot=False, weights={"model": "s3://models/lm/"})
        # The nodes' disk caches, as their heartbeats report them: bytes by object URL.
        shards = {"s3://models/lm/a.safetensors": 7 << 30, "s3://models/lm/b.safetensors": 1}
        env.say(wire.AgentHeartbeat(cached_weights=shards), holder)
        other = {"s3://models/other.safetensors": 9 << 30}
        env.say(wire.AgentHeartbeat(cached_weights=other), roomy)
        # A heartbeat that does not fit its type (a size that is not a number) is dropped.
        bad = '{"type": "heartbeat", "cached_weights": {"s3://models/x": "many"}}'
        env.cluster.messages.from_worker(roomy, bad)
        assert roomy.cached_weights == {"s3://models/other.safetensors": 9 << 30}
        assert env.cluster.replica_lifecycle.demand_of(env.runtime).weights_at == {
            (holder.id, (7 << 30) + 1)
        }
        env.submit()
        env.tick()
        assert env.started(env.commands(roomy)) == []  # more CPU free, but GBs to download
        assert len(env.started(env.commands(holder))) == 1

    run(tmp_path, scenario, with_worker=False)


def test_a_draining_node_finishes_its_inputs_and_new_replicas_go_elsewhere(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1, max_replicas=2)
        (first,) = env.start_ready()
        running = env.submit()
        assert env.inputs_sent(first) == [running.id]
        other = env.cluster.register_worker(hello(name="node-2"))
        assert env.cluster.roster.drain_node("node-1") == 1
        assert first.state is ReplicaState.DRAINING
        assert "node node-1 is draining" in env.logs()
        env.tick()  # min_replicas=1: a replacement, on the other node only
        (replacement,) = env.started(env.commands(other))
        assert env.commands() == []
        env.reply(first, "result", running, b"1")  # what it ran is served
        assert outcome_of(running) == Outcome(200, b"1")
        assert env.commands() == [{"type": "stop_replica", "replica_id": first.id, "grace": 30.0}]
        env.ready(replacement)
        env.cluster.roster.gone(other, "disconnected")
        # The only node left is draining: calls wait for it rather than fail.
        waiting = env.submit()
        env.tick()
        assert env.commands() == [] and not waiting.done
        assert env.cluster.roster.unservable_reason(env.runtime) is None
        # A control plane started again over the same store keeps the node drained.
        assert Cluster(env.config, env.store, env.cluster.logs).state.draining_nodes == {"node-1"}
        assert env.cluster.roster.uncordon_node("node-1") is True
        assert env.cluster.roster.uncordon_node("node-1") is False
        assert env.store.list_draining_nodes() == []
        env.tick()
        assert [c["type"] for c in env.commands()] == ["start_replica"]

    run(tmp_path, scenario)


def test_remove_app_fails_queued_inputs_and_drains_replicas(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=1, max_replicas=2)
        running, queued_1, queued_2 = env.submit(), env.submit(), env.submit()
        env.tick()
        busy, starting = env.started(env.commands())
        env.ready(busy)
        assert env.inputs_sent(busy) == [running.id]
        assert env.cluster.deployments.remove_app(APP) == 1
        assert LABEL not in env.cluster.endpoints
        for inp in (queued_1, queued_2):
            outcome = outcome_of(inp)
            assert outcome.status == 404
            assert error_of(outcome) == ("not_found", f"{LABEL}: app {APP} was stopped")
        assert busy.state is ReplicaState.DRAINING
        assert {"type": "kill_replica", "replica_id": starting.id} in env.commands()
        assert starting.id not in env.cluster.replicas
        # The input in flight still finishes; then the replica stops.
        env.reply(busy, "result", running, b"1")
        assert outcome_of(running) == Outcome(200, b"1")
        assert env.commands() == [{"type": "stop_replica", "replica_id": busy.id, "grace": 30.0}]
        late = Input("late", LABEL, FUNCTION_METHOD, b"{}", streaming=False, is_async=False)
        with pytest.raises(UnknownEndpoint) as caught:
            env.cluster.input_lifecycle.submit(late)
        assert http_error(caught.value).status == 404
        env.tick()
        assert env.commands() == []
        assert "stopped: app demo was stopped" in env.logs()

    run(tmp_path, scenario)


def test_redeploy_without_an_endpoint_removes_it(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        other = EndpointSpec(
            name="other",
            attribute="other",
            kind="function",
            settings=EndpointSettings(),
            methods={FUNCTION_METHOD: MethodSpec(FUNCTION_METHOD, False, False)},
        )
        manifest = AppManifest(APP, ENTRY, [other])
        env.cluster.deployments.apply(Deployment(APP, 2, DIGEST, manifest.to_dict(), time.time()))
        assert set(env.cluster.endpoints) == {make_label(APP, "other")}
        outcome = outcome_of(inp)
        assert outcome.status == 404
        assert "it was removed from the app" in error_of(outcome)[1]

    run(tmp_path, scenario)


# --- startup failures ---------------------------------------------------------------------


def test_three_startup_failures_fail_the_queue_with_backoff_between_starts(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        inp = env.submit()
        env.tick()
        (first,) = env.started(env.commands())
        before = time.time()
        env.exited(first, returncode=1)  # died before ready
        after = time.time()
        runtime = env.runtime
        assert runtime.startup_failures == 1
        assert before + 1.0 <= runtime.backoff_until <= after + 1.0
        assert not inp.done and list(runtime.pending) == [inp]
        env.commands()
        env.tick(runtime.backoff_until - 0.01)
        assert env.commands() == []  # backing off
        env.tick(runtime.backoff_until + 0.01)
        (second,) = env.started(env.commands())
        env.connect(second)
        before = time.time()
        env.reply(second, "startup_failed", error_type="ValueError", message="bad weights")
        after = time.time()
        assert runtime.startup_failures == 2
        assert runtime.last_startup_error == "ValueError: bad weights"
        assert before + 2.0 <= runtime.backoff_until <= after + 2.0  # doubled
        assert {"type": "kill_replica", "replica_id": second.id} in env.commands()
        assert second.id not in env.cluster.replicas
        env.exited(second, returncode=3)  # the process exit that follows is not counted again
        assert runtime.startup_failures == 2
        assert not inp.done
        env.tick(runtime.backoff_until - 0.01)
        assert env.commands() == []
        env.tick(runtime.backoff_until + 0.01)
        (third,) = env.started(env.commands())
        env.connect(third)
        env.reply(third, "startup_failed", error_type="RuntimeError", message="no model")
        assert runtime.startup_failures == STARTUP_FAILURES_BEFORE_GIVING_UP
        outcome = outcome_of(inp)
        assert outcome.status == 500
        error_type, message = error_of(outcome)
        assert error_type == "replica_start_failed"
        assert "RuntimeError: no model" in message
        assert f"ember logs {APP}" in message
        assert not runtime.pending
        assert "replica failed to start: RuntimeError: no model" in env.logs()

    run(tmp_path, scenario)


def test_startup_failure_message_of_an_exited_replica(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        inp = env.submit()
        for _ in range(STARTUP_FAILURES_BEFORE_GIVING_UP):
            env.tick(env.runtime.backoff_until + 0.01)
            (replica,) = env.started(env.commands())
            env.say(wire.ReplicaExited(replica_id=replica.id, detail="ImportError: x"))
        outcome = outcome_of(inp)
        assert outcome.status == 500
        error_type, message = error_of(outcome)
        assert error_type == "replica_start_failed"
        assert "its process ended (ImportError: x)" in message

    run(tmp_path, scenario)


def test_a_ready_replica_resets_the_startup_failure_count(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        inp = env.submit()
        for _ in range(STARTUP_FAILURES_BEFORE_GIVING_UP - 1):
            env.tick(env.runtime.backoff_until + 0.01)
            (replica,) = env.started(env.commands())
            env.exited(replica)
        assert env.runtime.startup_failures == STARTUP_FAILURES_BEFORE_GIVING_UP - 1
        (replica,) = env.start_ready(env.runtime.backoff_until + 0.01)
        assert env.runtime.startup_failures == 0
        assert env.inputs_sent(replica) == [inp.id]

    run(tmp_path, scenario)


def test_replica_not_ready_in_time_is_killed_as_a_startup_failure(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        inp = env.submit()
        env.tick()
        (replica,) = env.started(env.commands())
        env.tick(replica.created_at + 5.0)
        assert env.commands() == []
        env.tick(replica.created_at + 5.5)
        assert env.commands()[0] == {"type": "kill_replica", "replica_id": replica.id}
        assert env.runtime.startup_failures == 1
        assert "not ready after 5 s" in env.runtime.last_startup_error
        assert not inp.done

    run(tmp_path, scenario, startup_timeout=5.0)


def test_an_endpoints_own_startup_timeout_wins_over_the_servers(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, startup_timeout=20.0)
        env.submit()
        env.tick()
        (replica,) = env.started(env.commands())
        env.advance(replica.created_at + 19.0)  # past the server's 5 s, within its own 20
        assert env.commands() == []
        env.advance(replica.created_at + 20.5)
        assert env.commands()[0] == {"type": "kill_replica", "replica_id": replica.id}
        assert "not ready after 20 s (startup_timeout)" in env.runtime.last_startup_error

    run(tmp_path, scenario, startup_timeout=5.0)


# --- servability --------------------------------------------------------------------------


def test_a_node_with_no_gpu_free_after_all_is_no_startup_failure(tmp_path: Path) -> None:
    """The node refuses a replica placed on a GPU it no longer has free (fenced for its
    health before its heartbeat said so): the input waits, no failure is counted, and
    the node is offered no GPU replica until its next heartbeat is due."""

    async def scenario(env: Env) -> None:
        box = env.cluster.register_worker(hello(name="gpu-box", gpus={"H100": 1}))
        env.deploy(gpu="H100", max_replicas=1)
        inp = env.submit()
        refused = "cannot start: 1 x H100 GPU wanted, 0 of this node's 1 are free"
        for _ in range(STARTUP_FAILURES_BEFORE_GIVING_UP + 1):
            env.tick(time.time())
            (replica,) = env.started(env.commands(box))
            env.say(wire.ReplicaExited(replica_id=replica.id, detail=refused, no_room=True), box)
            assert not inp.done and env.runtime.startup_failures == 0
            env.tick(time.time())
            assert env.started(env.commands(box)) == []  # its GPUs count as taken for now
            box.gpus_refused_at = time.time() - 3.0  # as if its heartbeat came since
        assert f"replica lost: {refused}" in env.logs()

    run(tmp_path, scenario)


def test_a_node_whose_room_its_replicas_booked_is_offered_none_for_a_while(
    tmp_path: Path,
) -> None:
    """The node refuses a replica placed on CPUs its other replicas booked (ones this
    process does not know of: another control plane's, or one just taking over): the
    input waits, no failure is counted, the next start goes to another node, and the
    full node is offered replicas again once its next heartbeat is due."""

    async def scenario(env: Env) -> None:
        full = env.worker
        env.deploy(max_replicas=1)
        inp = env.submit()
        env.tick(time.time())
        (replica,) = env.started(env.commands(full))
        refused = "cannot start: the node's replicas have 2 of its 2 CPUs and 0 of its ..."
        env.say(wire.ReplicaExited(replica_id=replica.id, detail=refused, node_full=True), full)
        assert not inp.done and env.runtime.startup_failures == 0
        spare = env.cluster.register_worker(hello(name="spare"))
        env.tick(time.time())
        assert env.started(env.commands(full)) == []  # counted as full for now
        (moved,) = env.started(env.commands(spare))
        assert moved.worker_id == spare.id
        assert f"replica lost: {refused}" in env.logs()
        full.room_refused_at = time.time() - 3.0  # as if its heartbeat came since
        env.say(wire.AgentHeartbeat(booked=[full.cpu, 512.0]), full)  # what it has booked

        def used() -> tuple[float, int]:
            nodes = {node.worker_id: node for node in env.cluster.state.capacities()}
            return nodes[full.id].cpu_used, nodes[full.id].memory_used

        assert used() == (full.cpu, 512)  # counted beside this process's own (none)
        env.say(wire.AgentHeartbeat(booked=[0.0, 0.0]), full)  # those replicas ended
        assert used() == (0.0, 0)

    run(tmp_path, scenario)


def test_gpu_type_no_worker_has_fails_queued_inputs_with_503(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.cluster.register_worker(hello(name="gpu-box", gpus={"A100": 2}))
        env.cluster.roster.started_at = time.time() - 3600.0
        env.deploy(gpu="H100")
        reason = env.cluster.roster.unservable_reason(env.runtime)
        assert reason is not None
        assert "1 x H100" in reason and "A100" in reason
        inp = env.submit()
        env.tick()
        outcome = outcome_of(inp)
        assert outcome.status == 503
        error_type, message = error_of(outcome)
        assert error_type == "no_capacity"
        assert message == f"{LABEL}: {reason}"
        assert env.commands() == []

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("gpu", "servable"), [("A100", True), ("A100:2", True), ("A100:4", False), ("T4", False)]
)
def test_gpu_count_and_type_decide_servability(tmp_path: Path, gpu: str, servable: bool) -> None:
    async def scenario(env: Env) -> None:
        gpu_box = env.cluster.register_worker(hello(name="gpu", gpus={"A100": 2}))
        env.cluster.roster.started_at = time.time() - 3600.0
        env.deploy(gpu=gpu)
        assert (env.cluster.roster.unservable_reason(env.runtime) is None) is servable
        inp = env.submit()
        env.tick()
        if servable:
            (replica,) = env.started(env.commands(gpu_box))
            assert replica.worker_id == gpu_box.id
            assert not inp.done
        else:
            assert outcome_of(inp).status == 503

    run(tmp_path, scenario)


def test_no_workers_is_a_verdict_only_after_the_startup_grace(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        assert env.cluster.roster.unservable_reason(env.runtime) is None  # workers may reconnect
        early = env.submit()
        env.tick()
        assert not early.done
        env.cluster.roster.started_at = time.time() - env.config.reconnect_grace_seconds - 1.0
        reason = env.cluster.roster.unservable_reason(env.runtime)
        assert reason is not None and "no worker nodes are registered" in reason
        env.tick()
        assert outcome_of(early).status == 503

    run(tmp_path, scenario, with_worker=False)


def test_gpu_inputs_wait_for_workers_during_the_startup_grace(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        # Just (re)started: the CPU worker is back, the GPU worker is still reconnecting.
        env.deploy(gpu="H100")
        inp = env.submit(is_async=True)
        env.tick()
        assert not inp.done, outcome_of(inp)
        gpu_box = env.cluster.register_worker(hello(gpus={"H100": 1}))
        env.tick()
        assert len(env.started(env.commands(gpu_box))) == 1

    run(tmp_path, scenario)


# --- leases -------------------------------------------------------------------------------


def test_silent_replica_is_killed_and_its_inputs_requeued(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        lease = env.config.lease_seconds
        env.deploy(max_replicas=1)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.sent(replica)
        replica.last_seen = time.time() - lease + 2.0
        env.tick()
        assert env.commands() == []
        replica.last_seen = time.time() - lease - 5.0
        env.reply(replica, "heartbeat")  # renews the lease
        env.tick()
        assert env.commands() == []
        replica.last_seen = time.time() - lease - 1.0
        env.tick()
        commands = env.commands()
        assert commands[0] == {"type": "kill_replica", "replica_id": replica.id}
        assert replica.id not in env.cluster.replicas
        assert inp.attempts == 1 and not inp.done
        # The same tick starts a replacement for the requeued input.
        (fresh,) = env.started(commands)
        env.ready(fresh)
        assert env.inputs_sent(fresh) == [inp.id]
        assert f"no heartbeat for {lease:g} s" in env.logs()

    run(tmp_path, scenario)


def test_silent_worker_is_dropped_with_its_replicas(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        silent = env.worker
        env.deploy(max_replicas=1)
        inp = env.submit()
        (replica,) = env.start_ready()
        assert replica.worker_id == silent.id
        assert env.inputs_sent(replica) == [inp.id]
        env.commands()
        spare = env.cluster.register_worker(hello(name="node-2"))
        # A heartbeat from the worker renews its lease.
        silent.last_seen = time.time() - 100.0
        env.say(wire.AgentHeartbeat(), silent)
        env.tick()
        assert silent.id in env.cluster.workers
        silent.last_seen = time.time() - env.config.worker_lease_seconds - 1.0
        env.tick()
        assert silent.id not in env.cluster.workers
        assert env.commands(silent) == [{"type": "<close>"}]  # no kill to a gone worker
        assert replica.id not in env.cluster.replicas
        assert replica.outbox is not None and env.sent(replica) == [({"type": "<close>"}, b"")]
        assert not inp.done and inp.attempts == 1
        (fresh,) = env.started(env.commands(spare))
        assert fresh.worker_id == spare.id
        env.ready(fresh)
        assert env.inputs_sent(fresh) == [inp.id]

    run(tmp_path, scenario)


def test_replica_memory_from_heartbeats_reaches_the_metrics(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.submit()
        (replica,) = env.start_ready()
        other = env.cluster.register_worker(hello(name="node-2"))
        beat = wire.AgentHeartbeat(replica_memory={replica.id: 700 * 2**20, "r-x": 5})
        env.say(beat, other)  # not its replica: ignored
        assert replica.memory_bytes is None
        env.say(beat)
        assert replica.memory_bytes == 700 * 2**20
        update_gauges(env.cluster)
        text = env.cluster.metrics.exposition().decode()
        labels = f'app="{APP}",endpoint="{ENDPOINT}",replica="{replica.id}"'
        assert f"ember:replica_memory_bytes{{{labels}}} 7.340032e+08" in text
        env.exited(replica)
        update_gauges(env.cluster)
        assert "ember:replica_memory_bytes{" not in env.cluster.metrics.exposition().decode()

    run(tmp_path, scenario)


def test_each_nodes_replicas_and_drain_are_in_the_metrics(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(min_replicas=1)
        env.start_ready()
        env.cluster.register_worker(hello(name="node-2"))
        env.cluster.roster.drain_node("node-2")
        update_gauges(env.cluster)
        text = env.cluster.metrics.exposition().decode()
        assert 'ember:node_replicas{node="node-1"} 1.0' in text
        assert 'ember:node_replicas{node="node-2"} 0.0' in text
        assert 'ember:node_draining{node="node-1"} 0.0' in text
        assert 'ember:node_draining{node="node-2"} 1.0' in text

    run(tmp_path, scenario)


# --- async calls --------------------------------------------------------------------------


def test_async_call_is_persisted_through_its_life(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        body = b'{"prompt": "hi"}'
        inp = env.submit(body, is_async=True)
        record = env.store.get_call(inp.id)
        assert record is not None
        assert (record.status, record.attempts, record.label, record.method) == (
            CallStatus.QUEUED,
            0,
            LABEL,
            FUNCTION_METHOD,
        )
        assert record.body == body and record.finished_at is None and record.result is None
        (replica,) = env.start_ready()
        record = env.store.get_call(inp.id)
        assert record is not None
        assert (record.status, record.attempts) == (CallStatus.RUNNING, 1)
        env.reply(replica, "result", inp, b'{"out": 1}')
        record = env.store.get_call(inp.id)
        assert record is not None
        assert record.status is CallStatus.SUCCEEDED
        assert (record.http_status, record.result) == (200, b'{"out": 1}')
        assert record.finished_at is not None
        assert outcome_of(inp) == Outcome(200, b'{"out": 1}')
        # A failing one is stored as failed, with its error body.
        failing = env.submit(is_async=True)
        env.reply(replica, "error", failing, status=500, error_type="ValueError", message="no")
        record = env.store.get_call(failing.id)
        assert record is not None
        assert (record.status, record.http_status) == (CallStatus.FAILED, 500)
        assert record.result == outcome_of(failing).body

    run(tmp_path, scenario)


def fill_up(store: SqliteStateStore) -> None:
    """No new page for the database: SQLite then fails writes as on a full disk."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")


def make_room(store: SqliteStateStore) -> None:
    store._db.execute("PRAGMA max_page_count = 1073741823")


def test_a_full_state_store_refuses_new_async_calls_and_keeps_results(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, concurrency=4)
        accepted = env.submit(b'{"n": "accepted"}', is_async=True)
        (replica,) = env.start_ready()
        assert env.inputs_sent(replica) == [accepted.id]
        fill_up(env.store)

        # A new async call cannot be recorded, so it is refused and leaves no trace.
        big = json.dumps({"text": "x" * 20_000}).encode()  # needs pages the store lacks
        with pytest.raises(DiskFull) as refused:
            env.submit(big, is_async=True)
        assert (http_error(refused.value).status, refused.value.error_type) == (
            507,
            "insufficient_storage",
        )
        assert "could not record it" in refused.value.message
        assert len(env.cluster.inputs) == 1 and not env.runtime.pending
        # Synchronous calls keep no record: they are served as usual.
        sync = env.submit(b'{"n": "sync"}')
        assert env.inputs_sent(replica) == [sync.id]
        env.reply(replica, "result", sync, b'"fine"')
        assert outcome_of(sync) == Outcome(200, b'"fine"')

        # The accepted call's result comes while the store is full: held, not lost.
        env.reply(replica, "result", accepted, big)
        stored = env.store.get_call(accepted.id)
        assert stored is not None and stored.status is CallStatus.RUNNING
        held = env.cluster.calls.get(accepted.id)
        assert held is not None
        assert (held.status, held.http_status, held.result) == (CallStatus.SUCCEEDED, 200, big)
        env.tick()
        assert env.cluster.calls.held == 1

        make_room(env.store)
        env.tick()  # every tick writes what was held
        assert env.cluster.calls.held == 0
        stored = env.store.get_call(accepted.id)
        assert stored is not None
        assert (stored.status, stored.result) == (CallStatus.SUCCEEDED, big)
        again = env.submit(b'{"n": "again"}', is_async=True)
        assert env.store.get_call(again.id) is not None

    run(tmp_path, scenario)


def test_async_call_requeued_after_a_lost_replica_is_stored_as_queued(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        inp = env.submit(is_async=True)
        (replica,) = env.start_ready()
        env.exited(replica)
        record = env.store.get_call(inp.id)
        assert record is not None
        assert (record.status, record.attempts) == (CallStatus.QUEUED, 1)

    run(tmp_path, scenario)


def test_async_stream_collects_events_into_a_list(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(streaming=True)
        inp = env.submit(is_async=True)
        assert not hasattr(inp, "events")  # only synchronous streams get a queue
        (replica,) = env.start_ready()
        env.reply(replica, "event", inp, b"1")
        env.reply(replica, "event", inp, b'{"a": 2}')
        env.reply(replica, "end", inp)
        assert outcome_of(inp) == Outcome(200, b'[1,{"a": 2}]')
        record = env.store.get_call(inp.id)
        assert record is not None and record.result == b'[1,{"a": 2}]'

    run(tmp_path, scenario)


def test_recover_calls_after_a_restart(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        settings: dict[str, Any] = {"retries": 1, "concurrency": 1, "max_replicas": 3}
        env.deploy(**settings)
        # `exhausted`: running its second attempt (retries=1) when the process dies.
        exhausted = env.submit(b'{"n": "exhausted"}', is_async=True)
        (first,) = env.start_ready()
        env.exited(first)
        (second,) = env.start_ready()
        assert exhausted.replica_id == second.id and exhausted.attempts == 2
        # `running`: in its first attempt.
        running = env.submit(b'{"n": "running"}', is_async=True)
        (third,) = env.start_ready()
        assert running.replica_id == third.id and running.attempts == 1
        # `queued`: never dispatched. `finished`: done, must not come back.
        queued = env.submit(b'{"n": "queued"}', is_async=True)
        env.store.put_call(
            CallRecord(
                "finished", LABEL, FUNCTION_METHOD, b"{}", CallStatus.SUCCEEDED, 1, 1.0, 2.0, 200
            )
        )
        env.store.put_call(
            CallRecord("orphan", "gone--fn", FUNCTION_METHOD, b"{}", CallStatus.QUEUED, 0, 1.0)
        )

        # The control plane restarts: a new Cluster over the same database.
        store = SqliteStateStore(env.config.db_path)
        try:
            cluster = Cluster(env.config, store, LogSink(env.config.log_dir))
            controller = Controller(cluster)
            worker = cluster.register_worker(WORKER_HELLO)
            cluster.deployments.apply(deployment(**settings))
            assert cluster.input_lifecycle.recover_calls() == 2
            runtime = cluster.endpoints[LABEL]
            assert [(i.id, i.attempts, i.body) for i in runtime.pending] == [
                (running.id, 1, b'{"n": "running"}'),
                (queued.id, 0, b'{"n": "queued"}'),
            ]
            assert all(i.is_async for i in runtime.pending)
            for call_id in (running.id, queued.id):
                record = store.get_call(call_id)
                assert record is not None and record.status is CallStatus.QUEUED
            record = store.get_call(exhausted.id)
            assert record is not None
            assert (record.status, record.http_status) == (CallStatus.FAILED, 502)
            assert record.result is not None
            assert json.loads(record.result)["error"] == {
                "type": "replica_lost",
                "message": "the control plane restarted mid-run",
            }
            record = store.get_call("orphan")
            assert record is not None
            assert (record.status, record.http_status) == (CallStatus.FAILED, 404)
            record = store.get_call("finished")
            assert record is not None and record.status is CallStatus.SUCCEEDED
            # The recovered calls run to completion on the new control plane.
            pending = list(runtime.pending)
            controller.tick(time.time())
            started = [
                cluster.replicas[json.loads(worker.outbox.get_nowait())["replica_id"]]
                for _ in range(worker.outbox.qsize())
            ]
            assert len(started) == 2
            for replica in started:
                replica.outbox = asyncio.Queue()
                cluster.messages.from_replica(replica, wire.frame(wire.Ready()))
            for inp in pending:
                replica = cluster.replicas[inp.replica_id or ""]
                cluster.messages.from_replica(replica, wire.frame(wire.Result(id=inp.id), b'"ok"'))
                assert outcome_of(inp) == Outcome(200, b'"ok"')
                record = store.get_call(inp.id)
                assert record is not None and record.status is CallStatus.SUCCEEDED
            record = store.get_call(running.id)
            assert record is not None and record.attempts == 2
        finally:
            store.close()

    run(tmp_path, scenario)


def test_queue_limit_gives_429(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.submit()
        env.submit()
        with pytest.raises(QueueFull) as caught:
            env.submit()
        assert http_error(caught.value).status == 429
        assert http_error(caught.value).headers == {"Retry-After": "1"}
        assert len(env.runtime.pending) == 2

    run(tmp_path, scenario, max_queue=2)


def test_repr_of_a_plain_input_works() -> None:
    async def main() -> None:
        inp = Input("i", LABEL, FUNCTION_METHOD, b"{}", streaming=False, is_async=False)
        assert repr(inp).startswith("Input(id='i'")

    asyncio.run(main())


def test_inputs_wait_for_a_restarting_last_worker(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.cluster.roster.started_at = time.time() - 3600.0
        env.cluster.roster.gone(env.worker, "crashed")
        # The only worker just left: not yet a verdict, the input queues.
        assert env.cluster.roster.unservable_reason(env.runtime) is None
        waiting = env.submit()
        env.tick()
        assert not waiting.done
        env.cluster.register_worker(WORKER_HELLO)
        env.tick()
        assert not waiting.done and env.runtime.replicas  # a replica starts on the new worker
        # Gone for longer than the grace: now it is a verdict.
        env.cluster.roster.gone(next(iter(env.cluster.workers.values())), "left")
        env.cluster.roster.worker_left_at = time.time() - env.config.reconnect_grace_seconds - 1
        env.tick()
        assert outcome_of(waiting).status == 503

    run(tmp_path, scenario)


def test_inputs_wait_for_a_restarting_worker_that_is_the_only_one_that_fits(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.cluster.roster.started_at = time.time() - 3600.0
        pooled = hello(name="node-gpu", labels={"pool": "a"})
        fitting = env.cluster.register_worker(pooled)
        env.deploy(node_labels={"pool": "a"})
        spawned = env.submit(is_async=True)
        env.cluster.roster.gone(fitting, "crashed")  # node-1, which does not fit, stays
        env.tick()
        assert not spawned.done  # a verdict only once it has had the time to come back
        env.cluster.register_worker(pooled)
        env.tick()
        assert not spawned.done and env.runtime.replicas
        # Gone for longer than the grace, it is a verdict.
        back = next(w for w in env.cluster.workers.values() if w.name == "node-gpu")
        env.cluster.roster.gone(back, "left")
        env.cluster.roster.worker_left_at = time.time() - env.config.reconnect_grace_seconds - 1
        env.tick()
        assert outcome_of(spawned).status == 503

    run(tmp_path, scenario)


def test_a_stored_app_that_fails_newer_checks_is_left_out_and_the_rest_serves(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        good = deployment(max_replicas=2)
        env.store.put_deployment(good)
        bad = deployment(max_replicas=2)
        # As an older release stored it: a buffer its max_replicas leaves no room for.
        manifest = json.loads(json.dumps(bad.manifest))
        manifest["app"] = "older"
        manifest["endpoints"][0]["settings"]["buffer_replicas"] = 2
        env.store.put_deployment(Deployment("older", 1, DIGEST, manifest, time.time()))
        refusals = env.cluster.deployments.resume()
        assert list(env.cluster.endpoints) == [LABEL]
        (refusal,) = refusals
        assert refusal.startswith("app older version 1 is not served") and (
            "buffer_replicas=2 leaves no room" in refusal
        )
        older_log = (env.config.log_dir / "older.jsonl").read_text()
        assert "deploy again" in older_log

    run(tmp_path, scenario)


def test_a_worker_may_not_take_a_joined_workers_name_but_may_come_back_as_itself(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.cluster.roster.gone(env.worker, "left")
        joined = hello(name="gpu-1", instance="aaaa", pid=41)
        first = env.cluster.register_worker(joined)
        env.deploy()
        env.submit()
        env.tick()
        (replica,) = env.started(env.commands(first))
        with pytest.raises(WorkerNameTaken, match="'gpu-1' is already joined \\(pid 41\\)"):
            env.cluster.register_worker(hello(name="gpu-1", instance="bbbb", pid=42))
        assert first.id in env.cluster.workers
        # The same agent reconnecting before its old channel was seen to close.
        again = env.cluster.register_worker(joined)
        assert first.id not in env.cluster.workers and again.id in env.cluster.workers
        assert replica.id not in env.cluster.replicas  # lost with the old session

    run(tmp_path, scenario)
