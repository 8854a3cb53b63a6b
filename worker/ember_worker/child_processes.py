"""The agent's child processes, started by `subprocess` and awaited through a pidfd.

The agent runs on uvloop, whose own subprocess support runs Python in the forked child
before it execs (`PyOS_AfterFork_Child`: the at-fork hooks, and any garbage collection
they set off). The agent has threads, and such a child can block for ever on a lock one
of them held at the fork. CI saw it: a replica that never started, its would-be process
stuck in a zstd compressor's destructor while a dump was packing an image in a thread.
`subprocess` forks and execs in C and runs no Python in the child."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT  # stderr only: into stdout's pipe or descriptor

STREAM_LIMIT = 1024 * 1024  # the longest line a reader's readline() takes


class Child:
    """A started child: its pid, its pipes as asyncio streams, its exit code once it has
    exited (negative: the signal that killed it), as with `asyncio.subprocess.Process`."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: asyncio.StreamWriter | None,
        stdout: asyncio.StreamReader | None,
        stderr: asyncio.StreamReader | None,
    ) -> None:
        self._popen = popen
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        # The pidfd stays valid until the child is reaped, which only _reaped does.
        self._pidfd = os.pidfd_open(popen.pid)
        self._loop.add_reader(self._pidfd, self._reaped)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    def _reaped(self) -> None:
        """The pidfd turned readable: the child has exited; reap it."""
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if self.stdin is not None:  # as asyncio does: nothing reads it any more
            self.stdin.close()
        code = self._popen.poll()
        if code is None:  # poll() gives way to a thread in wait(), though none waits here;
            code = self._popen.wait()  # a child that has exited is reaped at once
        self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        """Signal the child; ProcessLookupError once it has exited, like asyncio's."""
        if self._exited.done():
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)  # not yet reaped, so the pid is still this child's

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    async def communicate(self) -> tuple[bytes, bytes]:
        """Everything it writes to its pipes, read to their end, once it has exited."""

        async def whole(stream: asyncio.StreamReader | None) -> bytes:
            return await stream.read() if stream is not None else b""

        if self.stdin is not None:
            self.stdin.close()
        out, err = await asyncio.gather(whole(self.stdout), whole(self.stderr))
        await self.wait()
        return out, err


async def start(
    *command: str,
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    close_fds: bool = True,
    start_new_session: bool = False,
) -> Child:
    """Start `command`, as `asyncio.create_subprocess_exec` would: each of stdin, stdout
    and stderr is PIPE (a stream on the Child), DEVNULL, a descriptor, or None (ours)."""
    popen = subprocess.Popen(
        command,
        bufsize=0,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        env=env,
        pass_fds=pass_fds,
        close_fds=close_fds,
        start_new_session=start_new_session,
    )
    # The pipes go to the event loop's transports, which close them.
    ends = (popen.stdin, popen.stdout, popen.stderr)
    popen.stdin = popen.stdout = popen.stderr = None
    try:
        writer = await _writer(ends[0]) if ends[0] is not None else None
        readers = [await _reader(end) if end is not None else None for end in ends[1:]]
    except BaseException:
        for end in ends:
            if end is not None:
                end.close()
        with contextlib.suppress(ProcessLookupError):
            popen.kill()
        await asyncio.to_thread(popen.wait)
        raise
    return Child(popen, writer, readers[0], readers[1])


class _ReadToTheEnd(asyncio.StreamReaderProtocol):
    def eof_received(self) -> bool:
        super().eof_received()
        return False  # the transport closes itself (uvloop's would stay open)


async def _reader(end: IO[bytes]) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
    await loop.connect_read_pipe(lambda: _ReadToTheEnd(reader, loop=loop), end)
    return reader


async def _writer(end: IO[bytes]) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    # FlowControlMixin gives the writer's drain() its pause and resume, as asyncio's own
    # subprocess streams have.
    protocol: Any = asyncio.streams.FlowControlMixin(loop=loop)
    transport, _ = await loop.connect_write_pipe(lambda: protocol, end)
    return asyncio.StreamWriter(transport, protocol, None, loop)
