"""Bytes held in the control plane within budgets: the policy, waiting for room, large
results in pieces (the replica sends them, the control plane takes them whole, a lost
attempt's pieces never join the next one's), and what an input holds until answered."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cluster_harness import Env, outcome_of, run

from ember.wire import messages as wire
from ember.wire.limits import RESULT_PIECE_BYTES
from ember_platform.limits.held_bytes import ByteBudgets, HeldBytes, over_budget, workspace_of
from ember_worker.replica.results import ResultSender

BUDGETS = ByteBudgets(workspace=100, platform=300)


def test_a_workspace_is_full_at_its_budget_or_past_its_share_of_a_full_platform() -> None:
    assert not over_budget(99, 99, 1, BUDGETS)
    assert over_budget(100, 100, 1, BUDGETS)
    # The platform is full: those past an even share wait, the others go on.
    assert over_budget(80, 300, 4, BUDGETS)  # 75 each
    assert not over_budget(70, 300, 4, BUDGETS)
    assert not over_budget(99, 299, 3, BUDGETS)


def test_workspaces_of_labels_and_app_keys() -> None:
    assert workspace_of("team-a--shop--greet") == "team-a"
    assert workspace_of("shop--greet") == "main"
    assert workspace_of("not a label") == "main"


def test_room_comes_when_bytes_are_released_or_the_wait_ends() -> None:
    async def scenario() -> None:
        held = HeldBytes(BUDGETS)
        held.hold("a", 150)
        held.hold("b", 10)
        assert held.full("a") and not held.full("b")
        assert not await held.room("a", timeout=0.05)
        waiting = asyncio.ensure_future(held.room("a", timeout=5))
        await asyncio.sleep(0)
        held.release("a", 40)
        await asyncio.sleep(0)
        assert not waiting.done()  # 110: still full
        held.release("a", 20)
        assert await asyncio.wait_for(waiting, 1)
        assert held.by_workspace() == {"a": 90, "b": 10} and held.held == 100
        held.release("a", 90)
        assert held.by_workspace() == {"b": 10}

    asyncio.run(scenario())


def test_a_large_result_goes_in_pieces_and_small_ones_whole() -> None:
    sent: list[tuple[Any, str]] = []

    async def send(header: Any, body: str = "") -> None:
        sent.append((header, body))

    async def scenario() -> None:
        sender = ResultSender(send)
        await sender.result("i-1", len, "x" * (2 * RESULT_PIECE_BYTES + 10))
        await sender.result("i-2", len, "small")
        await sender.event("i-3", len, "y" * (2 * RESULT_PIECE_BYTES))  # events never

    asyncio.run(scenario())
    kinds = [(type(header).__name__, header.id, len(body)) for header, body in sent]
    assert kinds == [
        ("ResultPart", "i-1", RESULT_PIECE_BYTES),
        ("ResultPart", "i-1", RESULT_PIECE_BYTES),
        ("Result", "i-1", 12),  # the rest: ten characters and the JSON quotes
        ("Result", "i-2", 7),
        ("Event", "i-3", 2 * RESULT_PIECE_BYTES + 2),
    ]
    assert (
        "".join(body for header, body in sent if header.id == "i-1")
        == '"' + "x" * (2 * RESULT_PIECE_BYTES + 10) + '"'
    )


def test_pieces_make_one_result_held_until_answered(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        answers = env.cluster.state.answers
        env.reply(replica, "result_part", inp, b'"abc')
        env.reply(replica, "result_part", inp, b"def")
        assert answers.held == 0  # halves are not counted: they could wait for ever
        env.reply(replica, "result", inp, b'ghi"')
        assert outcome_of(inp).body == b'"abcdefghi"'
        assert answers.held == len(b'"abcdefghi"')
        assert env.cluster.state.bodies.held == len(inp.body)
        env.cluster.state.release_held(inp)  # its caller was answered
        assert answers.held == 0 and env.cluster.state.bodies.held == 0

    run(tmp_path, scenario)


def test_pieces_of_a_lost_attempt_are_not_part_of_the_next(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        (first,) = env.start_ready()
        env.inputs_sent(first)
        env.reply(first, "result_part", inp, b'"stale')
        env.exited(first)  # lost mid-result: the input is tried again
        env.tick()
        (second,) = env.start_ready()
        assert env.inputs_sent(second) == [inp.id]
        env.reply(second, "result", inp, b'"fresh"')
        assert outcome_of(inp).body == b'"fresh"'

    run(tmp_path, scenario)


def test_wire_result_parts_are_replica_messages() -> None:
    header, body = wire.from_replica(wire.frame(wire.ResultPart(id="i-1"), "abc"))
    assert isinstance(header, wire.ResultPart) and body == "abc"


def test_pieces_past_a_results_limit_fail_the_input_and_are_not_kept(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        piece = b"x" * (16 * 1024 * 1024)
        for _ in range(4):
            env.reply(replica, "result_part", inp, piece)
        assert not inp.done and inp.result_pieces == 4
        env.reply(replica, "result_part", inp, b"y")  # one byte past 64 MiB: a hostile replica
        assert outcome_of(inp).status == 500 and not inp.result_parts
        env.reply(replica, "result_part", inp, piece)  # what follows is dropped
        assert not inp.result_parts
        assert "more than 64 MiB of one result" in outcome_of(inp).body.decode()

    run(tmp_path, scenario)
