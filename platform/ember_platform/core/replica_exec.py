"""Commands run beside replicas (`ember replica exec`), relayed between the caller of
`POST /v1/replicas/{id}/exec` and the replica's worker; profiles (`ember profile`, `POST
/v1/replicas/{id}/profile`) travel the same way, py-spy's file as their output.

The worker runs the command and sends its output (`wire.ExecOutput`), then its exit
(`wire.ExecExit`); each session queues them for its caller's response. A caller that
goes away has the worker kill the command; a worker that goes away ends its sessions
with an error; a caller who reads slower than the command writes is cut off once
`MAX_BUFFERED_BYTES` wait for it, so that a chatty command cannot fill the control
plane's memory.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ember.wire import messages as wire

MAX_BUFFERED_BYTES = 8 * 1024 * 1024
MAX_COMMAND_BYTES = 64 * 1024
MAX_ARGUMENTS = 1024
MAX_TIMEOUT_SECONDS = 86_400.0
MAX_STDIN_BYTES = 8 * 1024 * 1024  # input handed in whole, in an HTTP request
# Input sent while it runs (`-i`, `-t`): relayed without flow control, so capped.
MAX_STREAMED_INPUT_BYTES = 64 * 1024 * 1024


class Sender(Protocol):
    id: str

    def send(self, message: wire.ToAgent) -> None: ...


@dataclass(frozen=True)
class ExecRequest:
    command: list[str]
    timeout: float | None = None
    stdin: str | None = None  # base64 of what the command reads, then end of file
    interactive: bool = False  # its input comes while it runs (`wire.ExecInput`)
    terminal: tuple[int, int] | None = None  # rows and columns of its pseudo-terminal
    profile: wire.ProfileSpec | None = None  # `ember profile`: py-spy, run by the agent


def check_profile(body: Any) -> ExecRequest:
    """A profile request's JSON body (`wire.ProfileSpec`'s fields) as the exec that runs
    it; ValueError says what is wrong with it."""
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object: {"mode": "record", "duration": 10}')
    try:
        spec = msgspec.convert(body, wire.ProfileSpec)
    except msgspec.ValidationError as exc:
        raise ValueError(
            f"{exc}: mode is record or dump, format flamegraph or speedscope, duration "
            "above 0 and at most 600 seconds, rate 1 to 1000 samples a second"
        ) from None
    if spec.mode == "dump":
        said = ["py-spy", "dump"]
    else:
        said = ["py-spy", "record", f"{spec.duration:g} s", spec.format]
    return ExecRequest(said + (["(native)"] if spec.native else []), profile=spec)


def check_command(body: Any) -> ExecRequest:
    """The command, timeout and standard input of an exec request's JSON body;
    ValueError says what is wrong with it."""
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object: {"command": ["ls", "-l"]}')
    command = body.get("command")
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(arg, str) for arg in command)
    ):
        raise ValueError('"command" must be a non-empty list of strings, e.g. ["ls", "-l"]')
    if not command[0]:
        raise ValueError("the command's name is empty")
    if len(command) > MAX_ARGUMENTS or sum(len(arg.encode()) for arg in command) > (
        MAX_COMMAND_BYTES
    ):
        raise ValueError(
            f"the command is too long (at most {MAX_ARGUMENTS} arguments, "
            f"{MAX_COMMAND_BYTES // 1024} KiB in all)"
        )
    if any("\0" in arg for arg in command):
        raise ValueError("the command's arguments may not hold NUL characters")
    timeout = body.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_TIMEOUT_SECONDS
    ):
        raise ValueError(
            f'"timeout" must be a number of seconds above 0 and at most {MAX_TIMEOUT_SECONDS:g}'
        )
    stdin = body.get("stdin")
    if stdin is not None:
        try:
            size = len(base64.b64decode(stdin, validate=True)) if isinstance(stdin, str) else -1
        except (binascii.Error, ValueError):
            size = -1
        if size < 0:
            raise ValueError('"stdin" must be base64 text')
        if size > MAX_STDIN_BYTES:
            raise ValueError(
                f"the command's standard input is {size} bytes; at most "
                f"{MAX_STDIN_BYTES // 2**20} MiB (copy larger files with ember.Volume)"
            )
    terminal = body.get("terminal")
    if terminal is not None and (
        not isinstance(terminal, list)
        or len(terminal) != 2
        or not all(type(n) is int and 1 <= n <= 1000 for n in terminal)
    ):
        raise ValueError('"terminal" must be [rows, columns], each from 1 to 1000')
    return ExecRequest(
        command,
        float(timeout) if timeout is not None else None,
        stdin,
        interactive=body.get("interactive") is True,
        terminal=(terminal[0], terminal[1]) if terminal is not None else None,
    )


ExecEvent = wire.ExecOutput | wire.ExecExit  # what its caller reads, in order


@dataclass(eq=False)
class ExecSession:
    id: str
    worker: Sender
    replica_id: str
    events: asyncio.Queue[ExecEvent] = field(default_factory=asyncio.Queue)
    buffered: int = 0  # bytes of output queued for the caller
    input_bytes: int = 0  # sent by the caller while it runs
    ended: bool = False  # its exit (or an error standing for one) is queued
    started_at: float = field(default_factory=time.monotonic)
    outcome: wire.ExecExit | None = None  # its exit, once there is one

    def end(self, error: str, exit_code: int | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.outcome = wire.ExecExit(exec_id=self.id, exit_code=exit_code, error=error)
            self.events.put_nowait(self.outcome)

    def describe_end(self) -> str:
        """How it ended, for the replica's log."""
        seconds = time.monotonic() - self.started_at
        if self.outcome is None:
            return f"exec {self.id} stopped after {seconds:.1f} s: its caller left"
        if self.outcome.error and self.outcome.exit_code is None:
            return f"exec {self.id} ended after {seconds:.1f} s: {self.outcome.error}"
        return f"exec {self.id} exited {self.outcome.exit_code} after {seconds:.1f} s"

    def send_input(self, data: bytes) -> None:
        """What the caller typed or piped, for the command's standard input; past
        `MAX_STREAMED_INPUT_BYTES` the command is stopped instead."""
        if self.ended:
            return
        self.input_bytes += len(data)
        if self.input_bytes > MAX_STREAMED_INPUT_BYTES:
            self.worker.send(wire.ExecKill(exec_id=self.id))
            self.end(
                f"the command was stopped: its input went over "
                f"{MAX_STREAMED_INPUT_BYTES // 2**20} MiB (copy files with ember.Volume)"
            )
            return
        encoded = base64.b64encode(data).decode("ascii")
        self.worker.send(wire.ExecInput(exec_id=self.id, data=encoded))

    def end_input(self) -> None:
        if not self.ended:
            self.worker.send(wire.ExecInput(exec_id=self.id, eof=True))

    def resize(self, rows: int, cols: int) -> None:
        if not self.ended:
            self.worker.send(wire.ExecResize(exec_id=self.id, rows=rows, cols=cols))

    async def next_event(self) -> ExecEvent:
        event = await self.events.get()
        if isinstance(event, wire.ExecOutput):
            self.buffered -= len(event.data)
        return event


class ExecSessions:
    """The exec sessions in flight, by id."""

    def __init__(self) -> None:
        self.sessions: dict[str, ExecSession] = {}

    def open(self, worker: Sender, replica_id: str, request: ExecRequest) -> ExecSession:
        session = ExecSession("x-" + secrets.token_hex(6), worker, replica_id)
        self.sessions[session.id] = session
        worker.send(
            wire.Exec(
                exec_id=session.id,
                replica_id=replica_id,
                command=request.command,
                timeout=request.timeout,
                stdin=request.stdin,
                interactive=request.interactive,
                terminal=request.terminal,
                profile=request.profile,
            )
        )
        return session

    def close(self, session: ExecSession) -> None:
        """The caller is done with it: a command still running is killed."""
        self.sessions.pop(session.id, None)
        if not session.ended:
            session.ended = True
            session.worker.send(wire.ExecKill(exec_id=session.id))

    def message(self, worker: Sender, event: ExecEvent) -> None:
        """A command's output or its exit, from the worker that runs it."""
        session = self.sessions.get(event.exec_id)
        if session is None or session.worker.id != worker.id or session.ended:
            return
        if isinstance(event, wire.ExecExit):
            session.ended = True
            session.outcome = event
            session.events.put_nowait(event)
            return
        size = len(event.data)
        if session.buffered + size > MAX_BUFFERED_BYTES:
            worker.send(wire.ExecKill(exec_id=session.id))
            session.end(
                "the command was stopped: it wrote output faster than its caller read it "
                f"(over {MAX_BUFFERED_BYTES // 2**20} MiB waited)"
            )
            return
        session.buffered += size
        session.events.put_nowait(event)

    def end_all(self, reason: str) -> None:
        """Kill every command in flight and tell its caller why."""
        for session in list(self.sessions.values()):
            if not session.ended:
                session.worker.send(wire.ExecKill(exec_id=session.id))
                session.end(reason)

    def worker_gone(self, worker: Sender, reason: str) -> None:
        for session in list(self.sessions.values()):
            if session.worker.id == worker.id:
                session.end(f"the replica's worker went away ({reason})")
