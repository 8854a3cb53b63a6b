"""What the agent keeps about each replica it runs on this node: its process once it
has one, its limits and cgroups, how it came to end, and a retake it waits on."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from ember.wire import messages as wire
from ember.wire.gangs import GangMember
from ember_worker.agent.replica_exec import ExecContext
from ember_worker.log_limits import LogLimit
from ember_worker.processes.cgroups import ReplicaCgroup
from ember_worker.processes.exits import oom_kill_count
from ember_worker.processes.replica_processes import ReplicaProcess
from ember_worker.processes.replica_users import ReplicaUser
from ember_worker.processes.sandbox_mounts import SandboxPlan

STDERR_TAIL_LINES = 20
LAST_WORDS_SECONDS = 2.0  # a line this recent at the exit may say why it came
# The runtime's notes of what went well (replica/boot.py, replica/inputs.py,
# ember.endpoints.multiplexing): a process that ends right after one did not end for
# what it says.
PASSING_NOTES = (
    "ember: restored from a snapshot",
    "ember: weights unchanged since the snapshot",
    "ember: input ",
)
PASSING_NOTE_PATTERN = re.compile(r"ember: [^:]+: (loaded|unloaded) model ")


@dataclass(eq=False)
class RunningReplica:
    replica_id: str
    app: str
    endpoint: str
    process: ReplicaProcess | None = None  # None while its bundle or image is fetched
    bundle_digest: str | None = None  # its bundle's folder is kept while it starts or runs
    image_digest: str | None = None  # likewise its image's root (image=)
    gang: GangMember | None = None  # its place in a gang, if it is a member of one
    stop_requested: int | None = None  # a signal asked for before the process existed
    # Its last lines of stderr, with when each came (time.monotonic()).
    stderr_tail: deque[tuple[float, str]] = field(
        default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES)
    )
    kill_timer: asyncio.TimerHandle | None = None
    memory_mib: int | None = None  # what its endpoint asks for
    memory_limit_mib: int | None = None  # its endpoint's hard cap, if it sets one
    cpu_limit: float | None = None  # likewise, in CPUs
    cpu: float | None = None  # the CPUs it was placed for (the node's share it books)
    cgroup: ReplicaCgroup | None = None  # where those caps are enforced
    log_limit: LogLimit | None = None  # its endpoint's log_rate= (None: the node's)
    memory_noted: bool = False  # its log was told it uses more
    memory_bytes: int | None = None  # what it used when last measured
    killed: bool = False  # the agent sent SIGKILL (else one means the OOM killer, or else)
    exit_cause: str | None = None  # why it ended, where the agent knows better than its status
    python: str | None = None  # the interpreter it runs with (its app's environment's)
    user: ReplicaUser | None = None  # who it runs as (None: as the worker, not sandboxed)
    sandbox: SandboxPlan | None = None  # its mount namespace's plan (None: none of its own)
    exec_context: ExecContext | None = None  # for `ember replica exec`, once it runs
    oom_kills_at_start: int | None = field(default_factory=oom_kill_count)
    # After a failed restore: the key it may take a new snapshot of, once the control
    # plane answers (None: it may not).
    retake: asyncio.Future[str | None] | None = None
    # What a hello says of it, so that a control plane taking over adopts it (None until
    # its process runs).
    held: wire.HeldReplica | None = None
    placed_at: float = field(default_factory=time.monotonic)  # when the node was told to run it

    def held_now(self) -> wire.HeldReplica | None:
        """What a hello sent now says of it."""
        if self.held is None:
            return None
        seconds = round(time.monotonic() - self.placed_at, 3)
        return msgspec.structs.replace(self.held, running_seconds=seconds)

    def signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.killed = True
        if self.process is None:
            self.stop_requested = sig
        else:
            self.process.signal(sig)

    def last_words(self, now: float) -> str | None:
        """Its last line of stderr if written just before it ended (a traceback's last
        line, a fatal error), to tell why; an older line, or one of the runtime's own
        notes, would name a cause it had nothing to do with."""
        if not self.stderr_tail:
            return None
        written, text = self.stderr_tail[-1]
        if now - written > LAST_WORDS_SECONDS:
            return None
        if text.startswith(PASSING_NOTES) or PASSING_NOTE_PATTERN.match(text):
            return None
        return text


def running(records: Iterable[RunningReplica]) -> list[RunningReplica]:
    """The replicas whose process runs: what a leaving node waits for. One still being
    launched has no input to finish, and its launch may wait on a control plane that is
    gone (its session ended, the replica given up as lost there)."""
    return [record for record in records if record.process is not None]
