"""How much memory a replica really uses, against the `memory=` its endpoint asks for.

The scheduler places replicas by what their endpoints ask for; nothing limits what a
replica then takes. A replica over its request is told once in its log, so that the
endpoint's `memory=` can be set right before the node runs out.
"""

from __future__ import annotations

from pathlib import Path

MIB = 1024 * 1024


def proportional_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's proportional set size (shared pages split among their users), or
    None if it is gone or the kernel does not tell."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return None


def tree_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """What a process and all its descendants use (their proportional set sizes)."""
    total = proportional_bytes(pid, proc)
    if total is None:
        return None
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            children = (proc / str(parent) / "task" / str(parent) / "children").read_text()
        except OSError:
            continue
        for child in map(int, children.split()):
            total += proportional_bytes(child, proc) or 0
            pending.append(child)
    return total


def over_request(used_bytes: int, memory_mib: int) -> str | None:
    """The line for the replica's log when it uses more than its endpoint asks for."""
    if used_bytes <= memory_mib * MIB:
        return None
    return (
        f"uses {used_bytes / MIB:.0f} MiB, more than the memory={memory_mib} (MiB) its "
        "endpoint asks for, which is what the scheduler counts: raise memory=, or the node "
        "may run out of memory (memory_limit= would cap it)"
    )
