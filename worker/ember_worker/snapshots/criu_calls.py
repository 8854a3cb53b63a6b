"""Running CRIU: one pycriu request (dump, restore) in a thread, killable on timeout with
whatever CRIU holds; the error lines of CRIU's logs; its timeouts from the environment."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from ember_worker.processes.cgroups import joined
from ember_worker.snapshots.errors import SnapshotError

DUMP_TIMEOUT = 180.0
RESTORE_TIMEOUT = 30.0
# Seconds, for nodes where CRIU needs longer (huge images, slow disks), or shorter.
DUMP_TIMEOUT_ENV = "EMBER_CRIU_DUMP_TIMEOUT"
RESTORE_TIMEOUT_ENV = "EMBER_CRIU_RESTORE_TIMEOUT"
LOG_LEVEL = 2  # errors and warnings: what a failure report needs, without slowing dumps
# Error lines CRIU writes on every run here that say nothing about a failure.
HARMLESS = ("RLIMIT_NOFILE",)


def timeout_from_env(name: str, default: float) -> float:
    """Seconds from the environment variable `name`, else `default` (ValueError naming
    the variable when it is not a positive number)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return seconds


def criu_error_lines(log: Path, limit: int = 8) -> str:
    """CRIU's own error lines from its log, for the replica's log and the control plane."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no CRIU log)"
    errors = [
        line.strip()
        for line in lines
        if ("Error" in line or "error" in line) and not any(h in line for h in HARMLESS)
    ]
    return " | ".join((errors or lines)[-limit:]) or "(empty CRIU log)"


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), from each process's parent in
    /proc; those that end meanwhile are left out."""
    children: dict[int, list[int]] = {}
    for task in Path("/proc").glob("[0-9]*"):
        try:
            # After the command's name, in parentheses and maybe with spaces: state, ppid.
            ppid = int((task / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(task.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


class _SwrkChannel:
    """How pycriu reaches `criu swrk`, started with `subprocess` instead of pycriu's own
    `os.fork()`: the agent has threads, and a child that runs Python between fork and exec
    can block forever on a lock another thread held at the fork (seen: a dump "hung" for
    180 s). subprocess forks and execs in C. pycriu calls only connect and disconnect."""

    def __init__(self, binary: str, cgroup_procs: Sequence[Path] = ()) -> None:
        self.binary = binary
        self.cgroup_procs = cgroup_procs  # the cgroups CRIU restores the replica in
        self.swrk: int | None = None  # the pid, for CriuCall.kill
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None

    def connect(self, daemon: bool) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        try:
            # close_fds=False: inheritable descriptors (a restore's pipes) must reach CRIU.
            command = [self.binary, "swrk", str(theirs.fileno())]
            command = joined(command, self.cgroup_procs)
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=False,
            )
        finally:
            theirs.close()
        self.swrk = self._process.pid
        self._socket = ours
        return ours

    def disconnect(self) -> None:
        if self._socket is not None:
            self._socket.close()
        if self._process is not None:
            self._process.wait()


class CriuCall:
    """One pycriu request run in a thread, killable on timeout (CRIU's swrk process)."""

    active: ClassVar[set[CriuCall]] = set()  # calls in flight, for abort_all()

    def __init__(self, binary: str, cgroup_procs: Sequence[Path] = ()) -> None:
        import pycriu

        self.pycriu = pycriu
        self.criu = pycriu.criu()
        self.criu._comm = _SwrkChannel(binary, cgroup_procs)

    @classmethod
    def abort_all(cls) -> None:
        for call in list(cls.active):
            call.kill()

    def kill(self) -> int:
        """End the call: kill CRIU's swrk process, every task it traces (a half-restored
        one, or a replica it was dumping: CRIU's parasite code may be in it) and every
        process it forked (a restore's helpers and tasks not yet handed over, which would
        otherwise wait forever, orphaned); how many traced tasks there were."""
        # pycriu keeps the swrk pid on its private comm object.
        swrk = getattr(getattr(self.criu, "_comm", None), "swrk", None)
        if not swrk:
            return 0
        # Its descendants are named before anything is killed: a killed parent's children
        # go to init, and would no longer be found below swrk.
        forked = descendants(swrk)
        traced = 0
        for task in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError, ValueError):
                status = (task / "status").read_text()
                if f"\nTracerPid:\t{swrk}\n" in status:
                    os.kill(int(task.name), signal.SIGKILL)
                    traced += 1
        for pid in [*forked, swrk]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return traced

    async def run(self, request: str, timeout: float) -> Any:
        call = getattr(self.criu, request)
        task = asyncio.ensure_future(asyncio.to_thread(call))
        self.active.add(self)
        task.add_done_callback(lambda _: self.active.discard(self))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            # Never leave the thread blocked on CRIU: it would hold up the agent's exit.
            traced = self.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
            if isinstance(exc, asyncio.CancelledError):
                raise
            held = f" holding {traced} process(es), killed with it" if traced else ""
            raise SnapshotError(
                f"CRIU {request} timed out after {timeout:g} s{held}", held_killed=bool(traced)
            ) from None
