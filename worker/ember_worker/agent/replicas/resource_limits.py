"""Replicas' memory, CPU and processes on this node: the cgroups that hold each to its
endpoint's memory_limit= and cpu_limit=, and to the node's cap on its processes and
threads (pids.max, `--replica-pids-max`: a fork bomb stays inside), image build steps'
cgroups (the same caps, the same egress rule), what each uses
(measured for the heartbeats), and the notes in its log when it uses more than it asks
for or its CPU limit held it back."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from ember_worker.agent.log_shipping import Note
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.processes.cgroups import (
    CPU,
    MEMORY,
    PIDS,
    CgroupTree,
    ReplicaCgroup,
    find_tree,
)
from ember_worker.processes.memory_use import over_request, tree_bytes

log = logging.getLogger("ember.worker")

# An image build step's memory (apt, pip and compilers, not a model): a step past it is
# killed by the kernel's OOM killer, inside its cgroup, and fails.
BUILD_STEP_MEMORY_MIB = 8 * 1024
MEMORY_CHECK_SECONDS = 5.0  # how often replicas' memory use is held against their request


class ResourceLimits:
    def __init__(
        self,
        node: str,
        replicas: Mapping[str, RunningReplica],
        note: Note,
        pids_max: int | None = None,
    ) -> None:
        self.node = node  # this worker's name, for the notes
        self.pids_max = pids_max  # every replica's cap on its processes and threads
        self.replicas = replicas
        self.note = note
        # Where the limits are enforced: found when the agent starts (find_tree).
        self.cgroups = CgroupTree.unavailable("the worker has not started yet")

    def find_tree(self) -> None:
        """This node's cgroup tree for replicas, and a warning for each limit it cannot
        enforce (blocking: cgroupfs reads)."""
        if os.geteuid() == 0:
            self.cgroups = find_tree()
        else:
            self.cgroups = CgroupTree.unavailable("the worker does not run as root")
        for controller in (MEMORY, CPU):
            problem = self.cgroups.problem(controller)
            if problem:
                log.warning("%s_limit= cannot be enforced on this node: %s", controller, problem)
        problem = self.cgroups.problem(PIDS)
        if problem and self.pids_max is not None:
            log.warning("replicas' pids.max cannot be enforced on this node: %s", problem)

    def remove_tree(self) -> None:
        self.cgroups.remove()

    def problem(self, controller: str) -> str | None:
        """Why this node cannot enforce limits of `controller`; None where it can."""
        return self.cgroups.problem(controller)

    def limit(self, record: RunningReplica) -> ReplicaCgroup | None:
        """The replica's own cgroups, capped at its endpoint's memory_limit= and
        cpu_limit=, and at the node's pids.max; None where none of them applies. A limit
        of the endpoint's this node cannot enforce is said in its log, and the replica
        runs without it."""
        memory, cpu = record.memory_limit_mib, record.cpu_limit
        pids = self.pids_max if not self.cgroups.problem(PIDS) else None
        asked = [
            (MEMORY, memory, f"memory_limit={memory} (MiB)"),
            (CPU, cpu, f"cpu_limit={cpu:g}" if cpu is not None else ""),
        ]
        for controller, limit, setting in asked:
            problem = self.cgroups.problem(controller)
            if limit is not None and problem:
                self.note(record, f"{setting} is not enforced on worker {self.node}: {problem}")
        if self.cgroups.problem(MEMORY):
            memory = None
        if self.cgroups.problem(CPU):
            cpu = None
        weighted = not self.cgroups.problem(CPU)  # its CPU weight, below the node's own
        if not weighted and memory is None and pids is None and self.cgroups.egress_base is None:
            return None  # (a group of its own all the same where the egress rule needs it)
        try:
            record.cgroup = self.cgroups.create(
                record.replica_id, memory_mib=memory, cpu_limit=cpu, pids_max=pids
            )
        except OSError as exc:
            asked.append((PIDS, pids, f"pids.max={pids}"))
            settings = " and ".join(s for _, limit, s in asked if limit is not None)
            self.note(record, f"{settings} could not be set, so it is not enforced: {exc}")
        return record.cgroup

    def build_step_cgroup(self, name: str) -> tuple[list[Path], Callable[[], None]]:
        """A cgroup for one image build step (`name`: unique on the node): its memory
        and pids.max capped as a replica's, the link-local egress rule holding for it as
        for replicas' groups. Its `cgroup.procs` files and what removes it; none where
        the node has no cgroups (blocking: cgroupfs writes)."""
        memory = None if self.cgroups.problem(MEMORY) else BUILD_STEP_MEMORY_MIB
        pids = None if self.cgroups.problem(PIDS) else self.pids_max
        if memory is None and pids is None and self.cgroups.egress_base is None:
            return [], _nothing
        try:
            group = self.cgroups.create(f"build-{name}", memory_mib=memory, pids_max=pids)
        except OSError as exc:
            log.warning("an image build step runs without its cgroup: %s", exc)
            return [], _nothing
        return group.procs_files, lambda: _removed(group)

    def note_cpu_throttling(self, record: RunningReplica) -> None:
        """Tell the replica's log how much its cpu_limit= held it back, if at all."""
        cgroup = record.cgroup
        throttling = cgroup.cpu_throttling() if cgroup is not None else None
        if cgroup is None or throttling is None or cgroup.cpu_limit is None:
            return
        line = throttling.describe(cgroup.cpu_limit)
        if line is not None:
            self.note(record, line)

    def cpu_throttled_seconds(self) -> dict[str, float]:
        """Seconds each replica with a cpu_limit= has waited for CPU time so far (a
        read of a small cgroupfs file each)."""
        waited = {}
        for replica_id, record in list(self.replicas.items()):
            throttling = record.cgroup.cpu_throttling() if record.cgroup is not None else None
            if throttling is not None:
                waited[replica_id] = throttling.throttled_seconds
        return waited

    async def watch_memory(self) -> None:
        """Measure each replica's memory use (sent with the heartbeats, for the metrics),
        and tell its log, once, when it uses more than its endpoint asks for."""
        while True:
            await asyncio.sleep(MEMORY_CHECK_SECONDS)
            for record in list(self.replicas.values()):
                process = record.process
                if process is None:
                    continue
                used = await asyncio.to_thread(tree_bytes, process.pid)
                record.memory_bytes = used
                if used is None or record.memory_mib is None or record.memory_noted:
                    continue
                if record.memory_limit_mib is not None:
                    continue  # it may use up to its limit: its endpoint says so
                note = over_request(used, record.memory_mib)
                if note is not None:
                    record.memory_noted = True
                    self.note(record, note)


def _nothing() -> None:
    return None


def _removed(group: ReplicaCgroup) -> None:
    group.remove()
