"""`ember replica exec`: a command run beside a replica, for debugging it (what files it
sees, `nvidia-smi`, `pip list` of its environment, `py-spy dump`), as `kubectl exec` and
`modal container exec` do.

The command runs on the replica's node in the replica's folder (its bundle), with the
environment its process was started with (its app's Python first on PATH, its secrets,
its GPUs) and in its cgroups, so that it counts against the replica's limits. Its
standard output and error go to the control plane in chunks as they come; it reads what
its caller handed it (`-i`), else nothing. It ends with the replica, at its timeout, or when
the control plane asks (its caller went away), and the processes it started end with it.
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

from ember_worker.replica_cgroups import joined

CHUNK_BYTES = 64 * 1024
# After a timeout, how long what the killed command had written may take to arrive.
DRAIN_SECONDS = 5.0
EXIT_TIMED_OUT = 124  # as coreutils' `timeout` says it
EXIT_CANNOT_RUN = 126  # as a shell says these two
EXIT_NOT_FOUND = 127

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ExecContext:
    """Where and how a replica's commands run."""

    cwd: Path
    env: dict[str, str]
    cgroup_procs: Sequence[Path] = field(default_factory=tuple)


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


async def _feed(stream: asyncio.StreamWriter | None, data: bytes | None) -> None:
    """Hand the command its standard input, then end of file; a command that stops
    reading first just does not get the rest."""
    if stream is None or data is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.write(data)
        await stream.drain()
    stream.close()


async def _pump(stream: asyncio.StreamReader | None, name: str, exec_id: str, send: Send) -> None:
    if stream is None:
        return
    while chunk := await stream.read(CHUNK_BYTES):
        await send(
            {
                "type": "exec_output",
                "exec_id": exec_id,
                "stream": name,
                "data": base64.b64encode(chunk).decode("ascii"),
            }
        )


async def run_exec(
    exec_id: str,
    context: ExecContext,
    command: list[str],
    timeout: float | None,
    send: Send,
    stdin: bytes | None = None,
) -> None:
    """Run `command`, sending its output and then its end (`exec_exit`). Cancelled, it
    kills the command's processes and sends nothing more."""
    try:
        process = await asyncio.create_subprocess_exec(
            *joined(command, context.cgroup_procs),
            cwd=context.cwd,
            env=context.env,
            stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as one
        )
    except OSError as exc:  # without cgroups to join, nothing stands between us and exec
        code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_RUN
        await _send_exit(send, exec_id, code, f"cannot run {command[0]!r}: {exc.strerror or exc}")
        return
    pumps = asyncio.ensure_future(
        asyncio.gather(
            _pump(process.stdout, "stdout", exec_id, send),
            _pump(process.stderr, "stderr", exec_id, send),
            _feed(process.stdin, stdin),
        )
    )
    try:
        async with asyncio.timeout(timeout):
            # Done once its output closes: what it started in the background and left
            # holding its output counts as part of it, as with ssh and kubectl exec.
            await asyncio.shield(pumps)
            returncode = await process.wait()
    except TimeoutError:
        _kill_group(process)
        await asyncio.wait({pumps}, timeout=DRAIN_SECONDS)  # what it wrote before
        pumps.cancel()
        await _reap(process)
        await _send_exit(
            send, exec_id, EXIT_TIMED_OUT, f"the command ran past its timeout of {timeout:g} s"
        )
        return
    except BaseException:
        _kill_group(process)
        pumps.cancel()
        await _reap(process)
        raise
    _kill_group(process)  # anything of its group still running goes with it
    await _send_exit(send, exec_id, exit_code(returncode), None)


async def _send_exit(send: Send, exec_id: str, code: int | None, error: str | None) -> None:
    message: dict[str, Any] = {"type": "exec_exit", "exec_id": exec_id, "exit_code": code}
    if error is not None:
        message["error"] = error
    await send(message)
