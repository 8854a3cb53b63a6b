"""Why a replica process ended, in words for its logs and its callers.

A replica the kernel's OOM killer ends dies of SIGKILL like one the agent kills; the
kernel's running count of OOM kills (`oom_kill` in /proc/vmstat, memory cgroups'
included) tells the two apart when it grew while the replica ran and the agent sent no
SIGKILL of its own.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

VMSTAT = Path("/proc/vmstat")
# Replicas are the processes the kernel should end first when a node runs out of memory,
# never the agent or the control plane (-1000 never, 1000 first).
REPLICA_OOM_SCORE_ADJ = 800


def oom_kill_count(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's count of OOM kills since boot; None where it is not told."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def describe_exit(
    returncode: int,
    *,
    killed_by_agent: bool,
    oom_kills_before: int | None,
    oom_kills_after: int | None,
    stderr_tail: str | None,
    memory_mib: int | None = None,
    over_limit_mib: int | None = None,
) -> str:
    """Why a replica's process ended, for its callers and its log. `over_limit_mib`:
    the memory_limit= whose cgroup saw an OOM kill (replica_cgroups.py)."""
    killed_unasked = returncode == -signal.SIGKILL and not killed_by_agent
    if killed_unasked and over_limit_mib is not None:
        return (
            "killed by the kernel's OOM killer (SIGKILL): it went over its endpoint's "
            f"memory_limit={over_limit_mib} (MiB); raise memory_limit= or make it use less"
        )
    oom_killed = (
        killed_unasked
        and oom_kills_before is not None
        and oom_kills_after is not None
        and oom_kills_after > oom_kills_before
    )
    if oom_killed:
        asks = f"the endpoint asks for memory={memory_mib} (MiB): " if memory_mib else ""
        return (
            "killed by the kernel's OOM killer (SIGKILL): memory ran out while it ran; "
            f"{asks}give it more memory= or make it use less"
        )
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    detail = f"exit code {returncode}"
    if returncode != 0 and stderr_tail:
        detail += ": " + stderr_tail
    return detail


def make_oom_preferred() -> None:
    """Have the kernel end this process before the platform's own when memory runs out.
    Raising one's own score needs no privilege; a restore keeps it (CRIU restores it)."""
    # A kernel without it: the default choice (the largest process) stands.
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text(str(REPLICA_OOM_SCORE_ADJ))
