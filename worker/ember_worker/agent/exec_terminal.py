"""The pseudo-terminal of an `ember replica exec -t` command: the command gets the pty's
far end as its standard input, output and error and as its controlling terminal (so a
shell, a REPL or `top` behaves as at a console, and Ctrl+C typed by the caller reaches it
as SIGINT); the agent reads and writes the near end."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import pty
import struct
import termios

from ember_worker.processes.process_env import system_tool

READ_BYTES = 64 * 1024
# `setsid --ctty` makes the command a session leader whose controlling terminal is its
# standard input: the pty. Programs, not Python between fork and exec (the agent has
# threads). Signals the agent ignores (SIGINT and SIGQUIT, when a script started it in the
# background) would stay ignored across exec, and Ctrl+C typed at the command would do
# nothing: coreutils' `env --default-signal` gives the command default handling.
# Both by absolute path, run with the agent's fixed environment: never found on a PATH
# the replica's tenant set.
SESSION_WITH_TERMINAL = [system_tool("setsid"), "--ctty", system_tool("env"), "--default-signal"]


def set_window_size(fd: int, rows: int, cols: int) -> None:
    """Tell the terminal (and, by SIGWINCH, the command) its size in characters."""
    rows, cols = max(1, min(rows, 1000)), max(1, min(cols, 1000))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Terminal:
    """A pty pair: the command's end (`far`) and ours (`near`, non-blocking)."""

    def __init__(self, rows: int, cols: int) -> None:
        self.near, self.far = pty.openpty()
        os.set_blocking(self.near, False)
        set_window_size(self.far, rows, cols)

    def close_far(self) -> None:
        """Once the command has it: ours would keep the pty open after the command ends."""
        with contextlib.suppress(OSError):
            os.close(self.far)

    def close(self) -> None:
        self.close_far()
        with contextlib.suppress(OSError):
            os.close(self.near)

    def resize(self, rows: int, cols: int) -> None:
        with contextlib.suppress(OSError):
            set_window_size(self.near, rows, cols)

    async def read(self) -> bytes:
        """What the command wrote next; b"" once every process that had the terminal
        has closed it (Linux answers EIO then)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return os.read(self.near, READ_BYTES)
            except BlockingIOError:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_reader(self.near, _settle, ready)
                try:
                    await ready
                finally:
                    loop.remove_reader(self.near)
            except OSError as exc:
                if exc.errno == errno.EIO:
                    return b""
                raise

    def read_now(self) -> bytes:
        """What the command wrote that is there to read now, without waiting."""
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := os.read(self.near, READ_BYTES):
                chunks.append(chunk)
        return b"".join(chunks)

    async def write(self, data: bytes) -> None:
        """Type `data` at the command, waiting while the terminal's buffer is full."""
        while data:
            try:
                written = os.write(self.near, data)
            except BlockingIOError:
                await asyncio.sleep(0.01)
                continue
            data = data[written:]
