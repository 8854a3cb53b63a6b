"""`ember replica exec`: a command run beside a replica, for debugging it (what files it
sees, `nvidia-smi`, `pip list` of its environment, `py-spy dump`), as `kubectl exec` and
`modal container exec` do.

The command runs as the replica runs: inside its sandbox (its mount, IPC, UTS and PID
namespaces, its seccomp filter), as its workspace's uid without capabilities
(processes/sandbox_exec.py), in its cgroups (it counts against the replica's limits),
in its folder (its bundle), with the environment its process was started with (its
app's Python first on PATH, its secrets, its GPUs). Never as root on the node: a deploy
token of its workspace may run it. Its
standard output and error go to the control plane in chunks as they come. It reads what
its caller sends, as it comes (`-i`), else nothing; with a terminal (`-t`) it runs on a
pseudo-terminal of the caller's size (`exec_terminal.py`). It ends with the replica, at
its timeout, or when the control plane asks (its caller went away), and the processes
it started end with it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.exec_terminal import SESSION_WITH_TERMINAL, Terminal
from ember_worker.processes.cgroups import joined
from ember_worker.processes.process_env import ROOT_ENV, env_file
from ember_worker.processes.sandbox_exec import with_command

CHUNK_BYTES = 64 * 1024
# After a timeout, how long what the killed command had written may take to arrive.
DRAIN_SECONDS = 5.0
EXIT_TIMED_OUT = 124  # as coreutils' `timeout` says it
EXIT_CANNOT_RUN = 126  # as a shell says these two
EXIT_NOT_FOUND = 127

Send = Callable[[wire.ExecOutput | wire.ExecExit], Awaitable[None]]


@dataclass(frozen=True)
class ExecContext:
    """Where and how a replica's commands run."""

    cwd: Path
    env: dict[str, str]
    cgroup_procs: Sequence[Path] = field(default_factory=tuple)
    # What runs the command inside the replica's sandbox, as its user
    # (processes/sandbox_exec.py); empty for a replica that runs as the worker's user.
    enter: Sequence[str] = field(default_factory=tuple)


def exit_code(returncode: int) -> int:
    """A process's end as a shell reports it: 128 + N for a signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def _reap(process: asyncio.subprocess.Process) -> None:
    """Wait (a while) for a killed command's end, so that its pipes are closed; one that
    escaped its group and keeps them open is left to the event loop's child watcher."""
    waiting = asyncio.ensure_future(process.wait())
    await asyncio.wait({waiting}, timeout=DRAIN_SECONDS)
    waiting.cancel()


async def _pump_stream(
    stream: asyncio.StreamReader | None, name: str, exec_id: str, send: Send
) -> None:
    if stream is None:
        return
    while chunk := await stream.read(CHUNK_BYTES):
        await _send_output(send, exec_id, name, chunk)


async def _pump_terminal(terminal: Terminal, exec_id: str, send: Send) -> None:
    while chunk := await terminal.read():
        await _send_output(send, exec_id, "stdout", chunk)


async def _send_output(send: Send, exec_id: str, name: str, chunk: bytes) -> None:
    data = base64.b64encode(chunk).decode("ascii")
    await send(wire.ExecOutput(exec_id=exec_id, stream=name, data=data))


class ExecRun:
    """One command beside a replica. `feed`, `end_input` and `resize` take what its
    caller sends while it runs (`interactive`); `stdin` is input handed in whole."""

    def __init__(
        self,
        exec_id: str,
        context: ExecContext,
        command: list[str],
        timeout: float | None,
        send: Send,
        *,
        stdin: bytes | None = None,
        interactive: bool = False,
        terminal_size: tuple[int, int] | None = None,
    ) -> None:
        self.exec_id = exec_id
        self.context = context
        self.command = command
        self.timeout = timeout
        self.send = send
        self.input: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: end of input
        self.reads = interactive or stdin is not None
        if stdin is not None:
            self.input.put_nowait(stdin)
            self.input.put_nowait(None)
        self.terminal = Terminal(*terminal_size) if terminal_size is not None else None

    def feed(self, data: bytes) -> None:
        self.input.put_nowait(data)

    def end_input(self) -> None:
        self.input.put_nowait(None)

    def resize(self, rows: int, cols: int) -> None:
        if self.terminal is not None:
            self.terminal.resize(rows, cols)

    async def run(self) -> None:
        """Run the command, sending its output and then its end (`exec_exit`).
        Cancelled, it kills the command's processes and sends nothing more."""
        try:
            await self._run()
        finally:
            if self.terminal is not None:
                self.terminal.close()

    async def _start(self) -> asyncio.subprocess.Process:
        env = dict(self.context.env)
        if self.terminal is not None:
            env.setdefault("TERM", "xterm-256color")
        if not self.context.enter:  # a worker that is not root: it runs as the worker
            return await self._spawn(list(self.command), env, ())
        # What runs before the command is root's: the command's environment (the
        # tenant's variables) goes to it as a file, read once it is the replica's user.
        env_fd = env_file(env)
        try:
            command = with_command(self.context.enter, env_fd, self.command)
            return await self._spawn(command, ROOT_ENV, (env_fd,))
        finally:
            os.close(env_fd)

    async def _spawn(
        self, command: list[str], env: dict[str, str], pass_fds: tuple[int, ...]
    ) -> asyncio.subprocess.Process:
        command = joined(command, self.context.cgroup_procs)
        if self.terminal is not None:
            far = self.terminal.far
            return await asyncio.create_subprocess_exec(
                *SESSION_WITH_TERMINAL,
                *command,
                cwd=self.context.cwd,
                env=env,
                stdin=far,
                stdout=far,
                stderr=far,
                pass_fds=pass_fds,
            )
        return await asyncio.create_subprocess_exec(
            *command,
            cwd=self.context.cwd,
            env=env,
            stdin=asyncio.subprocess.PIPE if self.reads else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as one
            pass_fds=pass_fds,
        )

    async def _write_input(self, process: asyncio.subprocess.Process) -> None:
        """What the caller sends, as it comes, then end of file (a terminal gets Ctrl+D,
        as typed). A command that stops reading first just does not get the rest."""
        while (data := await self.input.get()) is not None:
            if self.terminal is not None:
                await self.terminal.write(data)
            elif process.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    process.stdin.write(data)
                    await process.stdin.drain()
        if self.terminal is not None:
            await self.terminal.write(b"\x04")
        elif process.stdin is not None:
            process.stdin.close()

    async def _run(self) -> None:
        starting = asyncio.ensure_future(self._start())
        try:
            # Shielded: cancelled while it starts, asyncio would kill the command alone
            # and wait for its pipes, which what it started in the background holds open.
            process = await asyncio.shield(starting)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                process = await starting
                _kill_group(process)  # the whole group, as below
                await _reap(process)
            raise
        except OSError as exc:  # without cgroups to join, nothing stands between us and exec
            code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_RUN
            name = self.command[0]
            await _send_exit(self.send, self.exec_id, code, f"cannot run {name!r}: {exc.strerror}")
            return
        if self.terminal is not None:
            self.terminal.close_far()
            output = [_pump_terminal(self.terminal, self.exec_id, self.send)]
        else:
            output = [
                _pump_stream(process.stdout, "stdout", self.exec_id, self.send),
                _pump_stream(process.stderr, "stderr", self.exec_id, self.send),
            ]
        pumps = asyncio.ensure_future(asyncio.gather(*output))
        # Cancelled when the command ends early: its outcome then is nobody's to read.
        pumps.add_done_callback(_retrieved)
        writer = asyncio.ensure_future(self._write_input(process)) if self.reads else None
        try:
            async with asyncio.timeout(self.timeout):
                # Done once its output closes: what it started in the background and left
                # holding its output counts as part of it, as with ssh and kubectl exec.
                await asyncio.shield(pumps)
                returncode = await process.wait()
        except TimeoutError:
            _kill_group(process)
            await asyncio.wait({pumps}, timeout=DRAIN_SECONDS)  # what it wrote before
            pumps.cancel()
            await _reap(process)
            message = f"the command ran past its timeout of {self.timeout:g} s"
            await _send_exit(self.send, self.exec_id, EXIT_TIMED_OUT, message)
            return
        except BaseException:
            _kill_group(process)
            pumps.cancel()
            await _reap(process)
            raise
        finally:
            if writer is not None:
                writer.cancel()
        _kill_group(process)  # anything of its group still running goes with it
        await _send_exit(self.send, self.exec_id, exit_code(returncode), None)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark the outcome as read, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


async def _send_exit(send: Send, exec_id: str, code: int | None, error: str | None) -> None:
    """A command's end as its caller is told: its exit status, or None and why."""
    await send(wire.ExecExit(exec_id=exec_id, exit_code=code, error=error))
