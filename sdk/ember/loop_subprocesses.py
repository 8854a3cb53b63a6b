"""asyncio subprocesses for uvloop that run no Python in the forked child.

uvloop's own `subprocess_exec` runs Python in the child between fork and exec
(`PyOS_AfterFork_Child`: the at-fork hooks, and any garbage collection they set off). In
a process with threads that child can wait for ever on a lock another thread held at the
fork; CI saw a would-be replica stuck so in a zstd compressor's destructor, while the
agent packed an image in a thread. Here the child is started by `subprocess.Popen`, which
forks and execs in C, as asyncio's own loop does; its exit is seen through a pidfd. Every
Ember process (control plane, agent, replica, and so the user's code) gets these from
`ember.calling.eventloop`."""

from __future__ import annotations

import asyncio
import os
import subprocess
from asyncio.unix_events import _UnixSubprocessTransport  # type: ignore[attr-defined]
from collections.abc import Callable
from typing import Any


class PidfdSubprocessTransport(_UnixSubprocessTransport):
    """asyncio's Unix subprocess transport, told of the exit by a pidfd on the loop
    instead of a child watcher (uvloop has none of asyncio's)."""

    def watch_exit(self) -> None:
        pidfd = os.pidfd_open(self.get_pid())  # valid until the child is reaped, here

        def exited() -> None:
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
            # poll() reaps it, or gives the status close() or send_signal() already got.
            code = self._proc.poll()
            if code is None:  # poll() defers to a wait() in another thread: none waits
                code = self._proc.wait()
            self._process_exited(code)

        self._loop.add_reader(pidfd, exited)


async def start(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    args: Any,
    *,
    shell: bool,
    stdin: Any = subprocess.PIPE,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    universal_newlines: bool = False,
    bufsize: int = 0,
    encoding: Any = None,
    errors: Any = None,
    text: Any = None,
    **kwargs: Any,
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    """What `loop.subprocess_exec` and `subprocess_shell` return; the text modes asyncio's
    own loop refuses (its streams are bytes) are refused here too."""
    if universal_newlines:
        raise ValueError("universal_newlines must be False")
    if bufsize != 0:
        raise ValueError("bufsize must be 0")
    if text:
        raise ValueError("text must be False")
    if encoding is not None:
        raise ValueError("encoding must be None")
    if errors is not None:
        raise ValueError("errors must be None")
    protocol = protocol_factory()
    waiter = loop.create_future()
    transport = PidfdSubprocessTransport(
        loop, protocol, args, shell, stdin, stdout, stderr, 0, waiter=waiter, **kwargs
    )
    transport.watch_exit()  # before the try: without it, _wait() there would never end
    try:
        await waiter
    except BaseException:
        transport.close()  # kills it
        await transport._wait()
        raise
    return transport, protocol


def fork_safe_loop_class(base: type[asyncio.AbstractEventLoop]) -> type[Any]:
    """`base` (uvloop.Loop) with subprocesses started by `start`."""

    class ForkSafeLoop(base):  # type: ignore[valid-type,misc]
        async def subprocess_exec(
            self,
            protocol_factory: Callable[[], asyncio.SubprocessProtocol],
            program: Any,
            *args: Any,
            shell: bool = False,
            **options: Any,
        ) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
            if shell:
                raise ValueError("shell must be False")
            return await start(self, protocol_factory, (program, *args), shell=False, **options)

        async def subprocess_shell(
            self,
            protocol_factory: Callable[[], asyncio.SubprocessProtocol],
            cmd: str | bytes,
            *,
            shell: bool = True,
            **options: Any,
        ) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
            if not isinstance(cmd, (bytes, str)):
                raise ValueError("cmd must be a string")
            if not shell:
                raise ValueError("shell must be True")
            return await start(self, protocol_factory, cmd, shell=True, **options)

    ForkSafeLoop.__name__ = ForkSafeLoop.__qualname__ = f"ForkSafe{base.__name__}"
    return ForkSafeLoop
