"""`ember replica exec` commands end with their replica: one killed with its replica's
namespace, before the agent has seen the replica's own exit, ends saying so (not with
the 137 of its SIGKILL), whichever of the two comes first."""

from __future__ import annotations

import asyncio

from ember.wire import messages as wire
from ember_worker.agent.exec_runs import ExecRuns


def test_a_command_ending_while_its_replica_is_killed_says_the_replica_ended() -> None:
    sent: list[wire.ExecOutput | wire.ExecExit] = []

    async def send(message: wire.ExecOutput | wire.ExecExit) -> None:
        sent.append(message)

    async def scenario() -> None:
        runs = ExecRuns("node-1", send)
        of_r1, of_r2 = runs._send_for("r-1"), runs._send_for("r-2")
        await of_r1(wire.ExecExit(exec_id="e-0", exit_code=0))  # before: as it was
        runs.replica_ending("r-1")
        await of_r1(wire.ExecOutput(exec_id="e-1", stream="stdout", data="aGk="))
        await of_r1(wire.ExecExit(exec_id="e-1", exit_code=137))
        await of_r2(wire.ExecExit(exec_id="e-2", exit_code=137))  # another replica's
        await runs.end_for("r-1")  # the replica's exit seen: no longer ending
        await of_r1(wire.ExecExit(exec_id="e-3", exit_code=0))

    asyncio.run(scenario())
    exits = [(m.exec_id, m.exit_code, m.error) for m in sent if isinstance(m, wire.ExecExit)]
    assert exits == [
        ("e-0", 0, None),
        ("e-1", None, "replica r-1 ended, and the command with it"),
        ("e-2", 137, None),
        ("e-3", 0, None),
    ]
    assert [m.exec_id for m in sent if isinstance(m, wire.ExecOutput)] == ["e-1"]
