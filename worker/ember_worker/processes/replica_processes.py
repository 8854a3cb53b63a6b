"""Replica processes as the agent sees them: started cold or restored, with their pipes.

Every replica gets five pipes: a lifeline (its stdin; EOF means the agent is gone), its
stdout and stderr, a control pipe the agent writes its identity into, and a status pipe
it reports lifecycle events on ("quiet": ready to be snapshotted). Pipes, unlike
sockets, are what CRIU can hand over to a restored process (`inherit_fd`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ember_worker.identity import ReplicaSpec
from ember_worker.processes import procfs_tid
from ember_worker.processes.cgroups import joined
from ember_worker.processes.process_env import ENV_FD_OPTION, ROOT_ENV, env_file
from ember_worker.processes.replica_users import ReplicaUser

PID_NAMESPACE_INIT = Path(__file__).with_name("pid_namespace_init.py")


@dataclass
class ReplicaPipes:
    """Both ends of a replica's five pipes. `child_*` ends go to the replica."""

    child_stdin: int
    lifeline: int
    stdout: int
    child_stdout: int
    stderr: int
    child_stderr: int
    child_control: int
    control: int
    status: int
    child_status: int
    closed: set[int] = field(default_factory=set)

    @classmethod
    def create(cls) -> ReplicaPipes:
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        control_r, control_w = os.pipe()
        status_r, status_w = os.pipe()
        return cls(
            stdin_r, stdin_w, out_r, out_w, err_r, err_w, control_r, control_w, status_r, status_w
        )

    def child_ends(self) -> list[int]:
        return [
            self.child_stdin,
            self.child_stdout,
            self.child_stderr,
            self.child_control,
            self.child_status,
        ]

    def _close(self, fds: list[int]) -> None:
        # Each fd exactly once: a second close could hit a number the process has since
        # reused for another pipe, silently cutting another replica's reader off.
        for fd in fds:
            if fd not in self.closed:
                self.closed.add(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close_child_ends(self) -> None:
        self._close(self.child_ends())

    def close_all(self) -> None:
        self._close(
            [*self.child_ends(), self.lifeline, self.stdout, self.stderr, self.control, self.status]
        )


def pipe_key(fd: int) -> str:
    """How CRIU names a pipe in an image: `pipe:[inode]`."""
    return f"pipe:[{os.fstat(fd).st_ino}]"


@dataclass(eq=False)
class ReplicaProcess:
    pid: int  # the replica's Python process (its PID namespace's init, seen from outside)
    pipes: ReplicaPipes
    wait: Callable[[], Awaitable[int]]  # the exit status, like Popen.returncode
    returncode: int | None = None
    extra_pids: list[int] = field(default_factory=list)  # wrapper processes to kill too
    # A restore's CUDA step (device memory back from the image): part of its restore time.
    gpu_restore_seconds: float | None = None

    def signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        # SIGTERM goes to the replica alone: its wrapper ignores it, and the replica drains.
        pids = (self.pid, *self.extra_pids) if sig == signal.SIGKILL else (self.pid,)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)


def pid_namespaces_available() -> str | None:
    """None if replicas can run in their own PID namespace here, else why not."""
    if os.geteuid() != 0:
        return "not running as root"
    probe = subprocess.run(
        [*in_pid_namespace(), "/bin/true"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return f"a new PID namespace failed: {probe.stderr.strip()}"
    return None


CAP_SYS_RESOURCE = 24


def holds_capability(cap: int) -> bool:
    """Whether this process's effective set has capability `cap`."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << cap))
    return False


def in_pid_namespace() -> list[str]:
    """The command prefix that runs a command as PID 1 of a new PID namespace and exits
    as it exits (`pid_namespace_init.py`, with the standard library only)."""
    return [sys.executable, "-I", "-S", str(PID_NAMESPACE_INIT)]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def spawn_cold(
    spec: ReplicaSpec,
    pipes: ReplicaPipes,
    env: dict[str, str],
    *,
    pid_namespace: bool,
    cgroup_procs: Sequence[Path] = (),
    python: str = sys.executable,
    user: ReplicaUser | None = None,
    sandbox: Path | None = None,
    root_until_snapshot: bool = False,
    boot: Sequence[str] | None = None,
    net_ns: int | None = None,
) -> ReplicaProcess:
    """Start `python -m ember_worker.replica.boot` (with the app's environment's `python`;
    `python *boot` on an image), in a new PID namespace when possible, in the cgroups of
    `cgroup_procs` (its limits'), as `user` where given (the namespace's init gives up
    root before the exec), in the sandbox whose plan is the file `sandbox` (its own
    mounts, seccomp), as uid 0 without capabilities until its snapshot is taken where
    `root_until_snapshot`, in the network namespace open as `net_ns` where given."""
    # -P: the app's folder (its working directory) is not put first on sys.path, so a
    # file of the app's named like a module of the standard library (json.py,
    # logging.py) cannot shadow one that the runtime imports; the loader adds the
    # folder itself once the runtime is up, as a script's own would be.
    command = [python, *(boot or ("-P", "-m", "ember_worker.replica.boot"))]
    # The replica's environment (its tenant's variables among it) never reaches the root
    # processes before its exec: they run with ROOT_ENV and hand it on as a file.
    env_fd: int | None = None
    if pid_namespace:
        # The replica is PID 1 of its namespace; a restore recreates the namespace, so
        # restored replicas keep their PIDs and run side by side.
        as_user = ["--user", user.argument()] if user is not None else []
        if sandbox is not None:
            as_user += ["--sandbox", str(sandbox)]
        if root_until_snapshot:
            as_user.append("--root-until-snapshot")
        if sandbox is None:  # its /proc lists the node's thread ids (a sandbox's: its own)
            env = procfs_tid.with_preload(env)
        env_fd = env_file(env)
        as_user += [ENV_FD_OPTION, str(env_fd)]
        if net_ns is not None:
            as_user += ["--net-ns", str(net_ns)]
        command = [*in_pid_namespace(), *as_user, *command]
    command = joined(command, cgroup_procs)  # the shell execs: the pid stays the same
    passed: tuple[int, ...] = (pipes.child_control, pipes.child_status)
    if net_ns is not None and pid_namespace:
        passed = (*passed, net_ns)
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=pipes.child_stdin,
            stdout=pipes.child_stdout,
            stderr=pipes.child_stderr,
            pass_fds=passed if env_fd is None else (*passed, env_fd),
            env=env if env_fd is None else ROOT_ENV,
            cwd=spec.bundle_dir if sandbox is None else "/",  # a sandbox's is named inside
            start_new_session=True,
        )
    finally:
        if env_fd is not None:
            os.close(env_fd)
    pid = process.pid
    extra: list[int] = []
    if pid_namespace:
        # The init script forks its child once its interpreter is up: some 30 ms, longer
        # on a loaded node. Signals must go to that child (the script ignores SIGTERM).
        deadline = time.monotonic() + 10.0
        children: list[int] = []
        while time.monotonic() < deadline:
            children = _children(process.pid)
            if children or process.returncode is not None:
                break
            await asyncio.sleep(0.002)
        if children:
            pid, extra = children[0], [process.pid]

    async def wait() -> int:
        return await process.wait()

    return ReplicaProcess(pid=pid, pipes=pipes, wait=wait, extra_pids=extra)


def adopt_restored(pid: int, pipes: ReplicaPipes) -> ReplicaProcess:
    """A process CRIU restored as our child: wait for it through a pidfd."""
    loop = asyncio.get_running_loop()

    async def wait() -> int:
        pidfd = os.pidfd_open(pid)
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:  # the process exited
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return -1  # not our child: its status went to whoever is its parent
        return os.waitstatus_to_exitcode(status)

    return ReplicaProcess(pid=pid, pipes=pipes, wait=wait)


@dataclass(eq=False)
class PipeReader:
    """An asyncio reader over a pipe's read end, which it owns."""

    reader: asyncio.StreamReader
    # uvloop's transport keeps only the fd number: this file object must live as long as
    # the transport, or its garbage collection closes the fd under it.
    file: object
    transport: asyncio.ReadTransport

    def close(self) -> None:
        self.transport.close()


async def open_reader(fd: int) -> PipeReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1024 * 1024)
    file = os.fdopen(fd, "rb", 0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), file)
    return PipeReader(reader, file, transport)
