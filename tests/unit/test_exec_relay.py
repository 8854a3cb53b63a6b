"""The control plane's side of `ember replica exec`: what a request may ask, and how a
session relays a worker's output to its caller."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from ember.wire import messages as wire
from ember_platform.core.replica_exec import (
    MAX_BUFFERED_BYTES,
    MAX_STDIN_BYTES,
    MAX_STREAMED_INPUT_BYTES,
    ExecRequest,
    ExecSessions,
    check_command,
)


@dataclass
class FakeWorker:
    """Records what the control plane sends a worker, as the agent decodes it (a real one
    runs in the e2e tests)."""

    id: str
    sent: list[dict[str, Any]] = field(default_factory=list)

    def send(self, message: wire.ToAgent) -> None:
        self.sent.append(wire.to_builtins(wire.to_agent(wire.encode(message))))


def test_commands_are_lists_of_strings_with_an_optional_timeout() -> None:
    assert check_command({"command": ["ls", "-l"]}) == ExecRequest(["ls", "-l"])
    assert check_command({"command": ["sleep", "1"], "timeout": 5}) == ExecRequest(
        ["sleep", "1"], 5.0
    )
    assert check_command({"command": ["cat"], "stdin": "aGk="}).stdin == "aGk="
    typed = check_command({"command": ["sh"], "interactive": True, "terminal": [30, 90]})
    assert typed.interactive and typed.terminal == (30, 90)
    for body, needle in (
        ([], "JSON object"),
        ({}, "non-empty list"),
        ({"command": "ls"}, "non-empty list"),
        ({"command": ["ls", 3]}, "non-empty list"),
        ({"command": [""]}, "name is empty"),
        ({"command": ["echo", "a\0b"]}, "NUL"),
        ({"command": ["x"] * 2000}, "too long"),
        ({"command": ["ls"], "timeout": 0}, "timeout"),
        ({"command": ["ls"], "timeout": True}, "timeout"),
        ({"command": ["ls"], "timeout": "5"}, "timeout"),
        ({"command": ["cat"], "stdin": "not base64!"}, "must be base64"),
        ({"command": ["cat"], "stdin": 5}, "must be base64"),
        ({"command": ["sh"], "terminal": [30]}, "rows, columns"),
        ({"command": ["sh"], "terminal": [0, 80]}, "rows, columns"),
        ({"command": ["sh"], "terminal": ["30", "80"]}, "rows, columns"),
        ({"command": ["cat"], "stdin": "A" * (MAX_STDIN_BYTES // 3 * 4 + 8)}, "at most 8 MiB"),
    ):
        with pytest.raises(ValueError, match=needle):
            check_command(body)


def test_a_session_relays_output_then_the_end_and_kills_when_its_caller_leaves() -> None:
    async def scenario() -> None:
        sessions = ExecSessions()
        worker, other = FakeWorker("w-1"), FakeWorker("w-2")
        session = sessions.open(worker, "r-1", ExecRequest(["ls"], 3.0))
        assert worker.sent == [
            {
                "type": "exec",
                "exec_id": session.id,
                "replica_id": "r-1",
                "command": ["ls"],
                "timeout": 3.0,
            }
        ]
        output = wire.ExecOutput(exec_id=session.id, stream="stdout", data="aGk=")
        sessions.message(worker, output)
        sessions.message(other, output)  # not its worker: ignored
        assert session.buffered == 4
        assert await session.next_event() == output and session.buffered == 0
        sessions.message(worker, wire.ExecExit(exec_id=session.id, exit_code=0))
        assert await session.next_event() == wire.ExecExit(exec_id=session.id, exit_code=0)
        sessions.close(session)
        assert worker.sent[-1]["type"] == "exec"  # it had ended: nothing to kill
        running = sessions.open(worker, "r-1", ExecRequest(["sleep", "9"], stdin="eA=="))
        assert worker.sent[-1]["stdin"] == "eA=="  # its standard input goes with it
        running.send_input(b"typed")
        running.resize(40, 120)
        running.end_input()
        assert worker.sent[-3:] == [
            {"type": "exec_input", "exec_id": running.id, "data": "dHlwZWQ="},
            {"type": "exec_resize", "exec_id": running.id, "rows": 40, "cols": 120},
            {"type": "exec_input", "exec_id": running.id, "eof": True},
        ]
        sessions.close(running)  # its caller left first
        assert worker.sent[-1] == {"type": "exec_kill", "exec_id": running.id}
        assert sessions.sessions == {}

    asyncio.run(scenario())


def test_a_caller_who_reads_too_slowly_or_a_lost_worker_ends_the_session() -> None:
    async def scenario() -> None:
        sessions = ExecSessions()
        worker = FakeWorker("w-1")
        session = sessions.open(worker, "r-1", ExecRequest(["yes"]))
        chunk = "y" * (MAX_BUFFERED_BYTES // 4)
        for _ in range(5):
            sessions.message(
                worker, wire.ExecOutput(exec_id=session.id, stream="stdout", data=chunk)
            )
        assert worker.sent[-1] == {"type": "exec_kill", "exec_id": session.id}
        events = [await session.next_event() for _ in range(5)]
        assert [type(e) for e in events] == [wire.ExecOutput] * 4 + [wire.ExecExit]
        end = events[-1]
        assert isinstance(end, wire.ExecExit) and "faster than its caller read" in str(end.error)
        flood = sessions.open(worker, "r-1", ExecRequest(["cat"], interactive=True))
        flood.send_input(bytes(MAX_STREAMED_INPUT_BYTES))
        flood.send_input(b"one byte too many")
        assert worker.sent[-1] == {"type": "exec_kill", "exec_id": flood.id}
        end = await flood.next_event()
        assert isinstance(end, wire.ExecExit) and "its input went over 64 MiB" in str(end.error)
        lost = sessions.open(worker, "r-2", ExecRequest(["sleep", "9"]))
        sessions.worker_gone(worker, "disconnected")
        end = await lost.next_event()
        assert isinstance(end, wire.ExecExit) and end.exit_code is None
        assert "worker went away (disconnected)" in str(end.error)

    asyncio.run(scenario())
