"""The replicas this node runs, from the control plane's `start_replica` to their end:
each launched, its output shipped to its log, stopped (SIGTERM, then SIGKILL after its
grace) or killed when asked, and, once its process is gone, its GPUs, cgroups and exec
commands released and its end described to the control plane (`replica_exited`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import time

from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.control_channel import Send
from ember_worker.agent.exec_runs import ExecRuns
from ember_worker.agent.log_shipping import LogShipper
from ember_worker.agent.replicas.launch import ReplicaLauncher
from ember_worker.agent.replicas.node_room import refusal
from ember_worker.agent.replicas.resource_limits import ResourceLimits
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.agent.volume_copies import VolumeCopyCollector
from ember_worker.gpu_slots import GpuSlots, NoFreeGpu
from ember_worker.log_limits import LogLimit
from ember_worker.processes.exits import describe_exit, oom_kill_count
from ember_worker.processes.replica_processes import ReplicaProcess

log = logging.getLogger("ember.worker")

LAST_OUTPUT_SECONDS = 5.0  # a replica's output read after its process ended, at most


class ReplicaRuns:
    def __init__(
        self,
        config: AgentConfig,
        replicas: dict[str, RunningReplica],
        *,
        launcher: ReplicaLauncher,
        gpu_slots: GpuSlots,
        limits: ResourceLimits,
        execs: ExecRuns,
        logs: LogShipper,
        volume_copies: VolumeCopyCollector,
        send: Send,
    ) -> None:
        self.config = config
        self.replicas = replicas  # the node's, by id: from its start to its process's end
        self.launcher = launcher
        self.gpu_slots = gpu_slots
        self.limits = limits
        self.execs = execs
        self.logs = logs
        self.volume_copies = volume_copies
        self.send = send

    async def start(self, command: wire.StartReplica) -> None:
        """Run a replica of the `start_replica` command until it ends, and say how."""
        replica_id = command.replica_id
        full = refusal(
            self.replicas.values(),
            cpu=self.config.cpu,
            memory_mib=self.config.memory,
            wants_cpu=command.cpu,
            wants_memory_mib=command.memory,
        )
        if full is not None:
            # The sums (every tenant's) stay in this log; the endpoint's log gets the gist.
            log.warning("replica %s refused: %s", replica_id, full)
            detail = "cannot start: its CPUs or memory are booked on this node after all"
            await self._report_exit(replica_id, None, detail, node_full=True)
            return
        record = RunningReplica(
            replica_id,
            command.app,
            command.endpoint,
            memory_mib=command.memory,
            memory_limit_mib=command.memory_limit,
            cpu_limit=command.cpu_limit,
            cpu=command.cpu,
            log_limit=None if command.log_rate is None else LogLimit(command.log_rate),
        )
        self.replicas[replica_id] = record
        try:
            process = await self.launcher.launch(record, command)
        except Exception as exc:
            reason = str(exc)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                work_dir = self.config.work_dir
                reason = f"worker {self.config.name} has no disk space left in {work_dir}"
            log.error("replica %s: %s", replica_id, reason)
            self.replicas.pop(replica_id, None)
            self.gpu_slots.release(replica_id)
            await self.launcher.release(record)
            if record.cgroup is not None:
                await asyncio.to_thread(record.cgroup.remove)
            no_room = isinstance(exc, NoFreeGpu)
            await self._report_exit(replica_id, None, f"cannot start: {reason}", no_room=no_room)
            return
        record.process = process
        record.held = wire.HeldReplica(
            replica_id=replica_id,
            token=command.token,
            call_token=command.call_token,
            label=command.label,
            version=command.version,
            gpu_type=command.gpu_type,
            gpu_count=command.gpu_count,
            gang=command.gang,
        )
        if record.stop_requested is not None:
            process.signal(record.stop_requested)
        await self._run_to_exit(record, process)

    async def _run_to_exit(self, record: RunningReplica, process: ReplicaProcess) -> None:
        replica_id = record.replica_id
        readers = [
            asyncio.ensure_future(self.logs.ship_output(record, process.pipes.stdout, "stdout")),
            asyncio.ensure_future(self.logs.ship_output(record, process.pipes.stderr, "stderr")),
        ]
        returncode = await process.wait()
        process.returncode = returncode
        # What its pipes still hold is read for a while; a pipe kept open past that by a
        # process it handed the descriptor to is not its output, and keeps nothing here.
        _, late = await asyncio.wait(readers, timeout=LAST_OUTPUT_SECONDS)
        for reader in late:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        # Its last words are judged by when it ended, not by when the cleanup below is
        # done: on a busy node that took past LAST_WORDS_SECONDS, and lost the reason.
        ended_at = time.monotonic()
        process.pipes.close_all()
        if record.kill_timer is not None:
            record.kill_timer.cancel()
        self.replicas.pop(replica_id, None)
        self.gpu_slots.release(replica_id)  # the process is gone, and its GPU memory with it
        await self.execs.end_for(replica_id)
        self.volume_copies.collect_soon()  # its app's copies may be unused now
        self.launcher.bundles.trim_soon()  # and its bundle's folder
        await self.launcher.release(record)  # its working area
        over_limit = None
        if record.cgroup is not None:
            if record.cgroup.oom_kills():
                over_limit = record.cgroup.memory_limit_mib
            self.limits.note_cpu_throttling(record)
            if not await asyncio.to_thread(record.cgroup.remove):
                where = ", ".join(map(str, record.cgroup.paths))
                log.warning("replica %s: its cgroups %s stay busy", replica_id, where)
        detail = record.exit_cause or describe_exit(
            returncode,
            killed_by_agent=record.killed,
            oom_kills_before=record.oom_kills_at_start,
            oom_kills_after=oom_kill_count(),
            stderr_tail=record.last_words(ended_at),
            memory_mib=record.memory_mib,
            over_limit_mib=over_limit,
        )
        await self._report_exit(replica_id, returncode, detail)

    async def _report_exit(
        self,
        replica_id: str,
        returncode: int | None,
        detail: str,
        *,
        no_room: bool = False,
        node_full: bool = False,
    ) -> None:
        exited = wire.ReplicaExited(
            replica_id=replica_id,
            returncode=returncode,
            detail=detail,
            no_room=no_room,
            node_full=node_full,
        )
        await self.send(exited)

    def stop(self, replica_id: str, grace: float) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        replica.signal(signal.SIGTERM)  # the runtime drains, runs exit hooks, exits
        loop = asyncio.get_running_loop()
        replica.kill_timer = loop.call_later(grace, self._kill_after_grace, replica, grace)

    def kill(self, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None:
            self.execs.replica_ending(replica_id)
            replica.signal(signal.SIGKILL)

    async def stop_all(self, grace: float) -> None:
        """SIGTERM to every replica, SIGKILL to those still there after `grace`; returns
        once all are gone."""
        replicas = [r for r in self.replicas.values() if r.process is not None]
        for replica in replicas:
            replica.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(r.replica_id in self.replicas for r in replicas):
            await asyncio.sleep(0.05)
        for replica in replicas:
            if replica.replica_id in self.replicas:
                self._kill_after_grace(replica, grace)
        while any(r.replica_id in self.replicas for r in replicas):
            await asyncio.sleep(0.02)

    def _kill_after_grace(self, replica: RunningReplica, grace: float) -> None:
        """SIGKILL for a replica still there `grace` s after SIGTERM, said in its log: its
        exit hooks may not have run to the end, and the user should know why."""
        cause = (
            f"still running {grace:g} s after it was asked to stop (an input or an "
            "@ember.exit hook did not finish): killed with SIGKILL"
        )
        self.logs.note(replica, cause)
        replica.exit_cause = f"stopped, {cause}"
        self.execs.replica_ending(replica.replica_id)
        replica.signal(signal.SIGKILL)
