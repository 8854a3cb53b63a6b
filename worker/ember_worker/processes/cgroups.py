"""Hard limits for replicas (an endpoint's `memory_limit=` and `cpu_limit=`, and the
node's cap on each replica's processes), through cgroups.

A replica with a limit runs in a cgroup of its own, made under the agent's cgroup:
`<agent's cgroup>/ember-<agent pid>/<replica id>`. cgroup v2 has one such directory with
`memory.max` (and no swap) and `cpu.max`; cgroup v1 has one per hierarchy, in the memory
one (`memory.limit_in_bytes`) and the cpu one (`cpu.cfs_quota_us`). The kernel's OOM
killer then ends that replica, and no other, when it goes over its memory, and the CFS
scheduler holds it to its share of CPU time in each 100 ms period. The cgroup's own
`oom_kill` count says for certain that a replica was ended for its memory; `cpu.stat`
says how often it was held back. `pids.max` (every replica's, `--replica-pids-max`) caps
the processes and threads it may have at once: a fork bomb's forks fail inside its
replica (EAGAIN), and the node's other processes go on. Processes join their cgroups
before they run anything (`joined`), so every page they touch is charged there, a
restore's too: CRIU's restorer runs in the replica's cgroups and forks the restored
process there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024
MEMORY = "memory"
CPU = "cpu"
PIDS = "pids"
CONTROLLERS = (MEMORY, CPU, PIDS)
# The CFS period a cpu_limit= is a share of: the kernel's default, short enough that a
# limited replica's answers are delayed by tens of milliseconds at most.
CPU_PERIOD_US = 100_000
MIN_CPU_QUOTA_US = 1_000  # the kernel refuses less
# Replicas (and build steps: tenants' code) together weigh a quarter of one of the node's
# own processes when the CPUs are short: the control plane and agent on a shared node
# answer other tenants' calls first, whatever a replica spins on. Among themselves
# replicas share evenly (each its own group of the default weight).
REPLICAS_CPU_SHARES = 256  # cgroup v1 cpu.shares (a process's: 1024)
REPLICAS_CPU_WEIGHT = 25  # cgroup v2 cpu.weight (a process's group: 100)
SYS_CGROUP = "/sys/fs/cgroup"  # where a sandboxed replica finds its own groups
# Joins the cgroups whose procs files are the $0 arguments that follow, then runs the
# command. A shell, not Python between fork and exec: the agent has threads (see
# snapshots._SwrkChannel).
_JOIN_SCRIPT = (
    'n=$0; while [ "$n" -gt 0 ]; do '
    'echo $$ > "$1" || { echo "cannot join the cgroup $1" >&2; exit 126; }; '
    'shift; n=$((n - 1)); done; exec "$@"'
)


def joined(command: list[str], procs_files: Sequence[Path]) -> list[str]:
    """`command`, run from inside the cgroups whose `cgroup.procs` are `procs_files`."""
    if not procs_files:
        return command
    return ["/bin/sh", "-c", _JOIN_SCRIPT, str(len(procs_files)), *map(str, procs_files), *command]


def _read_counter(path: Path, name: str) -> int:
    """The `name N` line of a flat-keyed cgroup file; 0 where it is missing."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    return 0


def cpu_quota_us(cores: float) -> int:
    """The CPU time per period that `cores` CPUs' worth amounts to."""
    return max(MIN_CPU_QUOTA_US, round(cores * CPU_PERIOD_US))


@dataclass(frozen=True)
class CpuThrottling:
    """How a cpu_limit= has held a replica back: of the periods in which it ran, those
    in which it used up its share and waited for the next."""

    periods: int
    throttled_periods: int
    throttled_seconds: float

    def describe(self, cores: float) -> str | None:
        """A line for the replica's log, or None where the limit never held it back."""
        if not self.throttled_periods:
            return None
        share = 100 * self.throttled_periods / max(self.periods, 1)
        return (
            f"cpu_limit={cores:g} held it back in {share:.0f} % of the 100 ms periods in "
            f"which it ran ({self.throttled_seconds:.1f} s of waiting in all); raise "
            "cpu_limit= if its latency matters more"
        )


@dataclass(frozen=True)
class ReplicaCgroup:
    """One replica's cgroups: one directory on cgroup v2, one per hierarchy on v1."""

    version: int
    memory_path: Path | None = None
    cpu_path: Path | None = None
    memory_limit_mib: int | None = None
    cpu_limit: float | None = None
    pids_path: Path | None = None
    pids_max: int | None = None
    # Its cgroup v2 group (v2: the same as the others; v1: in the unified hierarchy, with
    # no controller), which the link-local egress rule matches (egress_rules.py).
    egress_path: Path | None = None

    @property
    def paths(self) -> list[Path]:
        found = [
            p
            for p in (self.memory_path, self.cpu_path, self.pids_path, self.egress_path)
            if p is not None
        ]
        return list(dict.fromkeys(found))  # v2: all are the same directory

    @property
    def procs_files(self) -> list[Path]:
        return [path / "cgroup.procs" for path in self.paths]

    def views(self) -> list[tuple[Path, str]]:
        """Its groups as its sandbox shows them, read-only, where programs look for their
        limits (/sys/fs/cgroup: the one group on v2, a folder per controller on v1)."""
        if self.version == 2:
            own = next((p for p in (self.memory_path, self.cpu_path, self.pids_path) if p), None)
            return [(own, SYS_CGROUP)] if own is not None else []
        named = ((MEMORY, self.memory_path), (CPU, self.cpu_path), (PIDS, self.pids_path))
        return [(path, f"{SYS_CGROUP}/{name}") for name, path in named if path is not None]

    def oom_kills(self) -> int:
        """How many processes the OOM killer has ended in it for going over its limit."""
        if self.memory_path is None:
            return 0
        if self.version == 1:  # the `oom_kill` line is there since Linux 4.13
            return _read_counter(self.memory_path / "memory.oom_control", "oom_kill")
        return _read_counter(self.memory_path / "memory.events", "oom_kill")

    def cpu_throttling(self) -> CpuThrottling | None:
        """How much its cpu_limit= has held it back so far; None without one."""
        if self.cpu_path is None or self.cpu_limit is None:
            return None
        stat = self.cpu_path / "cpu.stat"
        if self.version == 1:
            waited = _read_counter(stat, "throttled_time") / 1e9  # nanoseconds
        else:
            waited = _read_counter(stat, "throttled_usec") / 1e6
        return CpuThrottling(
            _read_counter(stat, "nr_periods"), _read_counter(stat, "nr_throttled"), waited
        )

    def remove(self, attempts: int = 50) -> bool:
        """Delete it once its processes have gone (an exit takes the kernel a moment to
        finish); False if it is still busy after `attempts` tries, 10 ms apart."""
        return all([_remove_when_empty(path, attempts) for path in self.paths])


def _remove_when_empty(path: Path, attempts: int) -> bool:
    for _ in range(attempts):
        try:
            path.rmdir()
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
    """Where this agent makes its replicas' cgroups, for each controller it can use, and
    why it cannot use the others."""

    version: int  # 0 where there is no tree at all
    bases: dict[str, Path] = field(default_factory=dict)  # controller: one dir per replica
    problems: dict[str, str] = field(default_factory=dict)  # controller: why it is off
    # The agent's cgroup v2 group of replicas (one child each, always), and its path from
    # the v2 root, as iptables' cgroup match names it; None without a v2 hierarchy.
    egress_base: Path | None = None
    egress_path: str | None = None

    @classmethod
    def unavailable(cls, why: str) -> CgroupTree:
        return cls(0, {}, {controller: why for controller in CONTROLLERS})

    def problem(self, controller: str) -> str | None:
        """Why this node cannot enforce limits of `controller`; None where it can."""
        if controller in self.bases:
            return None
        return self.problems.get(controller, f"no {controller} cgroup controller is available")

    def create(
        self,
        replica_id: str,
        *,
        memory_mib: int | None = None,
        cpu_limit: float | None = None,
        pids_max: int | None = None,
    ) -> ReplicaCgroup:
        """Cgroups for the replica with these limits, memory without swap (OSError if the
        kernel refuses; KeyError for a controller the tree lacks)."""
        memory_path = self.bases[MEMORY] / replica_id if memory_mib is not None else None
        # A cpu group for every replica where the node has the controller: all of them sit
        # under the agent's group, whose weight is a quarter of a process's (REPLICAS_CPU).
        weighted = cpu_limit is not None or CPU in self.bases
        cpu_path = self.bases[CPU] / replica_id if weighted else None
        pids_path = self.bases[PIDS] / replica_id if pids_max is not None else None
        egress = self.egress_base / replica_id if self.egress_base is not None else None
        group = ReplicaCgroup(
            self.version, memory_path, cpu_path, memory_mib, cpu_limit, pids_path, pids_max, egress
        )
        try:
            for path in group.paths:
                path.mkdir(exist_ok=True)
            if pids_path is not None and pids_max is not None:
                (pids_path / "pids.max").write_text(str(pids_max))
            if memory_path is not None and memory_mib is not None:
                self._limit_memory(memory_path, memory_mib * MIB)
            if cpu_path is not None and cpu_limit is not None:
                quota = cpu_quota_us(cpu_limit)
                if self.version == 1:
                    (cpu_path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (cpu_path / "cpu.cfs_quota_us").write_text(str(quota))
                else:
                    (cpu_path / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        except OSError:
            for path in group.paths:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return group

    def _limit_memory(self, path: Path, limit_bytes: int) -> None:
        limit = str(limit_bytes)
        if self.version == 1:
            (path / "memory.limit_in_bytes").write_text(limit)
            # Memory and swap together: the same figure leaves no room for swap.
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(limit)
            # TCP buffers are counted apart on v1, and only under a limit of their own:
            # without it what a replica's sockets (and its pasta's) hold counts nowhere.
            tcp = path / "memory.kmem.tcp.limit_in_bytes"
            if tcp.exists():
                tcp.write_text(limit)
        else:
            (path / "memory.max").write_text(limit)
            swap = path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")

    def remove(self) -> None:
        """Delete the tree (when the agent stops); cgroups that still hold processes stay."""
        for base in {*self.bases.values(), *filter(None, [self.egress_base])}:
            _remove_tree(base)


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


def _enable_v2(group: Path, controllers: Sequence[str], write: Callable[[Path, str], None]) -> None:
    """Let `group`'s children have these controls. cgroup v2 allows that only in a cgroup
    without processes of its own (the root aside): on EBUSY, the processes in it (the
    agent's) move to a leaf `ember-agent` first, as container runtimes do."""
    control = group / "cgroup.subtree_control"
    for controller in controllers:
        if controller in control.read_text().split():
            continue
        try:
            write(control, f"+{controller}")
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            leaf = group / "ember-agent"
            leaf.mkdir(exist_ok=True)
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, OSError):
                    write(leaf / "cgroup.procs", pid)
            write(control, f"+{controller}")


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _v1_parents(
    mounts: list[tuple[str, str, set[str]]], own: dict[str, str]
) -> tuple[dict[str, Path], dict[str, str]]:
    """The agent's own group in each v1 hierarchy of a controller, and why some have none."""
    parents: dict[str, Path] = {}
    problems: dict[str, str] = {}
    for controller in CONTROLLERS:
        mount = next((m for m in mounts if m[1] == "cgroup" and controller in m[2]), None)
        path = next((p for c, p in own.items() if controller in c.split(",")), None)
        if mount is None:
            problems[controller] = f"no {controller} cgroup controller is mounted"
        elif path is None:
            problems[controller] = f"this process is in no cgroup v1 {controller} group"
        else:
            parents[controller] = Path(mount[0]) / path.lstrip("/")
    return parents, problems


def find_tree(
    *,
    mounts_file: Path = Path("/proc/self/mounts"),
    cgroup_file: Path = Path("/proc/self/cgroup"),
    pid: int | None = None,
    write: Callable[[Path, str], None] = _write,
) -> CgroupTree:
    """This agent's tree of replica cgroups, made now (stale ones of agents that died
    are swept away), with why a controller it cannot use is off."""
    pid = os.getpid() if pid is None else pid
    try:
        mounts = _mounts(mounts_file)
        own = _own_cgroups(cgroup_file)
    except (OSError, ValueError) as exc:
        return CgroupTree.unavailable(f"cannot read this process's cgroups: {exc}")
    v1 = any(m[1] == "cgroup" and set(CONTROLLERS) & m[2] for m in mounts)
    v2 = next((m for m in mounts if m[1] == "cgroup2"), None)
    if v1:
        parents, problems = _v1_parents(mounts, own)
        version = 1
    elif v2 is not None and "" in own:
        version, problems = 2, {}
        parent = Path(v2[0]) / own[""].lstrip("/")
        try:
            offered = (parent / "cgroup.controllers").read_text().split()
        except OSError as exc:
            return CgroupTree.unavailable(f"cannot read the cgroup v2 controllers: {exc}")
        parents = {c: parent for c in CONTROLLERS if c in offered}
        for controller in set(CONTROLLERS) - set(parents):
            problems[controller] = f"cgroup v2 gives {own['']} no {controller} controller"
    else:
        return CgroupTree.unavailable("no memory or cpu cgroup controller is mounted")
    egress_base, egress_path = _egress_group(v2, own, pid, version)
    bases: dict[str, Path] = {}
    for controller, parent in parents.items():
        try:
            if version == 2:
                _enable_v2(parent, [controller], write)
            _sweep(parent)
            base = parent / f"ember-{pid}"
            base.mkdir(exist_ok=True)
            if version == 2:
                write(base / "cgroup.subtree_control", f"+{controller}")
            if controller == CPU:
                weight = REPLICAS_CPU_SHARES if version == 1 else REPLICAS_CPU_WEIGHT
                write(base / ("cpu.shares" if version == 1 else "cpu.weight"), str(weight))
            bases[controller] = base
        except OSError as exc:
            problems[controller] = f"cannot make {controller} cgroups: {exc}"
    return CgroupTree(version, bases, problems, egress_base, egress_path)


def _egress_group(
    v2: tuple[str, str, set[str]] | None, own: dict[str, str], pid: int, version: int
) -> tuple[Path | None, str | None]:
    """The agent's cgroup v2 group of replicas, made now, and its path from the v2 root:
    iptables matches sockets by their v2 group (also on a v1 node with the unified
    hierarchy mounted), whatever their uid. (None, None) where there is no v2 hierarchy."""
    if v2 is None or "" not in own:
        return None, None
    relative = own[""].strip("/")
    if version == 2 and relative.endswith("/ember-agent"):  # _enable_v2 moved us there
        relative = relative.removesuffix("/ember-agent")
    parent = Path(v2[0]) / relative
    base = parent / f"ember-{pid}"
    try:
        if version == 1:
            _sweep(parent)
        base.mkdir(exist_ok=True)
    except OSError:
        return None, None
    return base, str(Path(relative) / base.name)


def _sweep(parent: Path) -> None:
    """Remove the replica cgroups of agents that are no longer running."""
    for stale in parent.glob("ember-[0-9]*"):
        owner = stale.name.removeprefix("ember-")
        if owner.isdigit() and not _pid_alive(int(owner)):
            _remove_tree(stale)
