"""A replica's process started: its bundle and its app's Python environment made ready
and its cgroups made, then restored from a snapshot where asked and possible, else
booted cold (with a snapshot taken at its quiet point where asked). Its identity goes
into its control pipe once it may run on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.bundles import BundleCache
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.environments import PythonEnvironments
from ember_worker.agent.log_shipping import Note
from ember_worker.agent.replicas.provisioning import ReplicaProvisioning
from ember_worker.agent.replicas.replica_access import ReplicaAccess
from ember_worker.agent.replicas.resource_limits import ResourceLimits
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.gpu_slots import GpuSlots
from ember_worker.identity import ReplicaIdentity, ReplicaSpec
from ember_worker.processes.replica_processes import ReplicaPipes, ReplicaProcess, spawn_cold
from ember_worker.snapshots.replica_images import ReplicaSnapshots

Spawn = Callable[[Coroutine[Any, Any, None]], None]  # a task the agent keeps until done


class ReplicaLauncher:
    def __init__(
        self,
        config: AgentConfig,
        *,
        bundles: BundleCache,
        environments: PythonEnvironments,
        provisioning: ReplicaProvisioning,
        limits: ResourceLimits,
        gpu_slots: GpuSlots,
        snapshots: ReplicaSnapshots | None,
        pid_namespace: bool,
        access: ReplicaAccess | None,
        note: Note,
        spawn: Spawn,
    ) -> None:
        self.config = config
        self.bundles = bundles
        self.environments = environments
        self.provisioning = provisioning
        self.limits = limits
        self.gpu_slots = gpu_slots
        self.snapshots = snapshots  # None where snapshots are off
        self.pid_namespace = pid_namespace  # replicas get their own PID namespace
        # Replicas run as their workspace's uid (None: as the worker, which is not root).
        self.access = access
        self.note = note
        self.spawn = spawn

    async def launch(self, record: RunningReplica, command: wire.StartReplica) -> ReplicaProcess:
        """Start the replica's process: restored from a snapshot when asked and possible,
        else cold (taking a snapshot at its quiet point when asked). Its identity goes
        into the control pipe once it may run on."""
        record.bundle_digest = command.bundle_digest  # a user of the folder from now on
        # Checked against what was extracted (extracted again if it changed): before a
        # restore too, whose image maps the bundle's files at the same path.
        bundle_dir = await self.bundles.ensure(command.bundle_digest)
        identity = ReplicaIdentity(
            replica_id=record.replica_id,
            token=command.token,
            call_token=command.call_token,
            server_url=self.config.server_url,
            ca_cert=self.config.ca_cert,
            channel_socket=self.config.channel_socket,
            volumes_dir=self.config.volumes_dir,
            weights_cache_dir=str(self.config.weights_dir),
            weights_cache_bytes=self.config.weights_cache_bytes,
        )
        snapshot = command.snapshot
        if command.snapshot_note:
            self.note(record, command.snapshot_note)
        # The app's requirements.txt, installed once per node: before a restore too, as
        # the image maps the environment's files.
        python = await self.environments.python_for(
            bundle_dir, lambda text: self.note(record, text), command.requirements
        )
        record.python = python
        home = None
        if self.access is not None:
            record.user = self.access.user_for(command.app)
            home = await asyncio.to_thread(
                self.access.prepare,
                record.user,
                replica_id=record.replica_id,
                app_key=command.app,
                bundle_dir=bundle_dir,
                python=python,
            )
            identity = replace(identity, home=str(home), user=record.user.argument())
        cgroup = self.limits.limit(record)  # mkdirs and writes in cgroupfs: quick
        procs = cgroup.procs_files if cgroup is not None else []
        if snapshot is not None and snapshot.action == "restore" and self.snapshots is not None:
            process = await self.snapshots.restore(record, command, snapshot, identity, procs)
            if process is not None:
                gpus = self.gpu_slots.held(record.replica_id)
                if self.access is not None and record.user is not None:
                    self.access.grant_gpus(record.user, gpus)
                record.exec_context = self.provisioning.exec_context(
                    bundle_dir, command, gpus, procs, python, process.pid
                )
                return process
        gpus = self.provisioning.take_gpus(record, command)
        if self.access is not None and record.user is not None:
            await asyncio.to_thread(self.access.grant_gpus, record.user, gpus)
        pipes = ReplicaPipes.create()
        spec = ReplicaSpec(
            bundle_dir=bundle_dir,
            entry=command.entry,
            attribute=command.attribute,
            concurrency=command.concurrency,
            label=command.label,
            control_fd=pipes.child_control,
            status_fd=pipes.child_status,
        )
        env = self.provisioning.replica_env(command.env, gpus)
        env.update(spec.to_env())
        env.update(identity.working_area())
        env["PYTHONUNBUFFERED"] = "1"
        taking = (snapshot is not None and snapshot.action == "take") or record.retake is not None
        taking = taking and self.snapshots is not None
        # CRIU cannot dump an unprivileged process whose /proc is not its PID namespace's
        # (it has none of its own before replicas get a mount namespace): one to be dumped
        # boots as root and gives up root itself once it reads its identity, after the
        # dump (boot.py); a restored one likewise.
        if taking and record.user is not None:
            self.note(
                record,
                f"its snapshot phase (imports, enter(snap=True)) runs as root; it serves as "
                f"uid {record.user.uid}",
            )
        try:
            process = await spawn_cold(
                spec,
                pipes,
                env,
                pid_namespace=self.pid_namespace,
                cgroup_procs=procs,
                python=python,
                user=None if taking else record.user,
            )
        except BaseException:
            pipes.close_all()
            raise
        pipes.close_child_ends()
        record.exec_context = self.provisioning.exec_context(
            bundle_dir, command, gpus, procs, python, process.pid
        )
        if taking and self.snapshots is not None:
            self.spawn(self.snapshots.take_then_release(record, process, command, identity, gpus))
        else:
            os.write(pipes.control, identity.to_line())
        return process

    async def release(self, record: RunningReplica) -> None:
        """What the replica had on the node for itself goes (its process has ended)."""
        if self.access is not None and record.user is not None:
            await asyncio.to_thread(self.access.release, record.replica_id)
