"""Hard memory limits for replicas (an endpoint's `memory_limit=`), through memory cgroups.

A replica with a limit runs in a cgroup of its own, made under the agent's cgroup:
`<agent's cgroup>/ember-<agent pid>/<replica id>`, with cgroup v1's
`memory.limit_in_bytes` or v2's `memory.max` (and no swap). The kernel's OOM killer then
ends that replica, and no other, when it goes over; the cgroup's own `oom_kill` count
says so for certain. Processes join their cgroup before they run anything (`joined`),
so every page they touch is charged to it, a restore's too: CRIU's restorer runs in the
replica's cgroup and forks the restored process there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
# Joins the cgroup whose procs file is $0, then runs the command. A shell, not Python
# between fork and exec: the agent has threads (see snapshots._SwrkChannel).
_JOIN_SCRIPT = (
    'echo $$ > "$0" || { echo "cannot join the memory cgroup $0" >&2; exit 126; }; exec "$@"'
)


def joined(command: list[str], procs_file: Path) -> list[str]:
    """`command`, run from inside the cgroup whose `cgroup.procs` is `procs_file`."""
    return ["/bin/sh", "-c", _JOIN_SCRIPT, str(procs_file), *command]


def _read_counter(path: Path, name: str) -> int:
    """The `name N` line of a flat-keyed cgroup file; 0 where it is missing."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0


@dataclass(frozen=True)
class ReplicaCgroup:
    """One replica's cgroup."""

    path: Path
    version: int
    limit_mib: int

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def oom_kills(self) -> int:
        """How many processes the OOM killer has ended in it for going over its limit."""
        if self.version == 1:  # the `oom_kill` line is there since Linux 4.13
            return _read_counter(self.path / "memory.oom_control", "oom_kill")
        return _read_counter(self.path / "memory.events", "oom_kill")

    def remove(self, attempts: int = 50) -> bool:
        """Delete it once its processes have gone (an exit takes the kernel a moment to
        finish); False if it is still busy after `attempts` tries, 10 ms apart."""
        for _ in range(attempts):
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    return False
            time.sleep(0.01)
        return False


@dataclass(frozen=True)
class CgroupTree:
    """Where this agent makes its replicas' cgroups."""

    version: int
    base: Path  # holds one directory per replica

    def create(self, replica_id: str, limit_mib: int) -> ReplicaCgroup:
        """A cgroup for the replica, limited to `limit_mib`, without swap (OSError if the
        kernel refuses)."""
        path = self.base / replica_id
        path.mkdir(exist_ok=True)
        limit = str(limit_mib * MIB)
        try:
            if self.version == 1:
                (path / "memory.limit_in_bytes").write_text(limit)
                # Memory and swap together: the same figure leaves no room for swap.
                memsw = path / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(limit)
            else:
                (path / "memory.max").write_text(limit)
                swap = path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise
        return ReplicaCgroup(path, self.version, limit_mib)

    def remove(self) -> None:
        """Delete the tree (when the agent stops); cgroups that still hold processes stay."""
        _remove_tree(self.base)


def _remove_tree(base: Path) -> None:
    with contextlib.suppress(OSError):
        for child in base.iterdir():
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        base.rmdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mounts(mounts_file: Path) -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, options) of each mount."""
    found = []
    for line in mounts_file.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4:
            point = fields[1].replace("\\040", " ")
            found.append((point, fields[2], set(fields[3].split(","))))
    return found


def _own_cgroups(cgroup_file: Path) -> dict[str, str]:
    """The controllers' field of each line of /proc/self/cgroup, mapped to its path."""
    own = {}
    for line in cgroup_file.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        own[controllers] = path
    return own


def _enable_memory_v2(group: Path, write: Callable[[Path, str], None]) -> None:
    """Let `group`'s children have memory controls. cgroup v2 allows that only in a
    cgroup without processes of its own (the root aside): on EBUSY, the processes in it
    (the agent's) move to a leaf `ember-agent` first, as container runtimes do."""
    control = group / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return
    try:
        write(control, "+memory")
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        leaf = group / "ember-agent"
        leaf.mkdir(exist_ok=True)
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                write(leaf / "cgroup.procs", pid)
        write(control, "+memory")


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def find_tree(
    *,
    mounts_file: Path = Path("/proc/self/mounts"),
    cgroup_file: Path = Path("/proc/self/cgroup"),
    pid: int | None = None,
    write: Callable[[Path, str], None] = _write,
) -> CgroupTree | str:
    """This agent's tree of replica cgroups, made now (stale ones of agents that died
    are swept away), or why there can be none here."""
    pid = os.getpid() if pid is None else pid
    try:
        mounts = _mounts(mounts_file)
        own = _own_cgroups(cgroup_file)
    except (OSError, ValueError) as exc:
        return f"cannot read this process's cgroups: {exc}"
    v1 = next((m for m in mounts if m[1] == "cgroup" and "memory" in m[2]), None)
    v2 = next((m for m in mounts if m[1] == "cgroup2"), None)
    try:
        if v1 is not None:
            path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
            if path is None:
                return "this process is in no cgroup v1 memory group"
            parent, version = Path(v1[0]) / path.lstrip("/"), 1
        elif v2 is not None and "" in own:
            parent, version = Path(v2[0]) / own[""].lstrip("/"), 2
            if "memory" not in (parent / "cgroup.controllers").read_text().split():
                return f"cgroup v2 gives {own['']} no memory controller"
            _enable_memory_v2(parent, write)
        else:
            return "no memory cgroup controller is mounted"
        _sweep(parent)
        base = parent / f"ember-{pid}"
        base.mkdir(exist_ok=True)
        if version == 2:
            write(base / "cgroup.subtree_control", "+memory")
    except OSError as exc:
        return f"cannot make memory cgroups: {exc}"
    return CgroupTree(version, base)


def _sweep(parent: Path) -> None:
    """Remove the replica cgroups of agents that are no longer running."""
    for stale in parent.glob("ember-[0-9]*"):
        owner = stale.name.removeprefix("ember-")
        if owner.isdigit() and not _pid_alive(int(owner)):
            _remove_tree(stale)
