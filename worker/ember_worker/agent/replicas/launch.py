"""A replica's process started: its bundle and its app's Python environment made ready
and its cgroups made, then restored from a snapshot where asked and possible, else
booted cold (with a snapshot taken at its quiet point where asked). Its identity goes
into its control pipe once it may run on."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

from ember.images.image import Image
from ember.state.volume_paths import VOLUMES_DIR_ENV
from ember.wire import messages as wire
from ember_worker.agent.bundles import BundleCache
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.environments import PythonEnvironments
from ember_worker.agent.log_shipping import Note
from ember_worker.agent.replica_exec import ExecContext
from ember_worker.agent.replicas.gpu_driver_files import DriverFiles, node_driver_files
from ember_worker.agent.replicas.image_replicas import CA_INSIDE, ImageRun, image_run
from ember_worker.agent.replicas.provisioning import ReplicaProvisioning
from ember_worker.agent.replicas.replica_access import ReplicaAccess, gpu_device_nodes
from ember_worker.agent.replicas.resource_limits import ResourceLimits
from ember_worker.agent.replicas.sandboxes import ReplicaSandboxes
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.gpu_slots import GpuSlots
from ember_worker.identity import WEIGHTS_CACHE_DIR_ENV, ReplicaIdentity, ReplicaSpec
from ember_worker.images.image_roots import ImageRoots, python_in, runtime_python
from ember_worker.images.root_collection import ImageRootCollector
from ember_worker.processes.replica_processes import (
    CAP_SYS_RESOURCE,
    ReplicaPipes,
    ReplicaProcess,
    holds_capability,
    spawn_cold,
)
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME, SandboxPlan
from ember_worker.resources import GpuDevice
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
        sandboxes: ReplicaSandboxes | None,
        note: Note,
        spawn: Spawn,
        images: ImageRoots | None = None,
        image_collector: ImageRootCollector | None = None,
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
        self.sandboxes = sandboxes  # None: replicas share the node's mounts (no sandbox)
        # CRIU dumps a process of another uid only where it may read its rlimits: root
        # without CAP_SYS_RESOURCE (in a container) dumps processes of uid 0 alone.
        self.dumps_other_uids = holds_capability(CAP_SYS_RESOURCE)
        self.note = note
        self.spawn = spawn
        self.images = images  # the node's image roots (replicas of endpoints with image=)
        self.image_runs: dict[str, ImageRun] = {}  # by replica id, while it starts and runs
        self.image_collector = image_collector  # told when a replica of an image ends
        self._driver: DriverFiles | None = None  # the node's GPU driver files, once looked for

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
            server_urls=list(self.config.server_urls),
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
        image = await self._image_run(record, command)
        if image is None:
            builder = None  # its install runs as the workspace's user, never as root
            if self.access is not None:
                builder = self.access.user_for(command.app)
                await asyncio.to_thread(self.access.open_bundle, builder, bundle_dir)
            python = await self.environments.python_for(
                bundle_dir, lambda text: self.note(record, text), command.requirements, builder
            )
        else:  # the image's own, inside; the node's is what its grants are made for
            python = sys.executable
            if self.images is not None:  # lazy, or extracted and why (ember ls says)
                identity = replace(identity, image_root=self.images.describe(image.config.digest))
            if self.config.ca_cert:
                identity = replace(identity, ca_cert=CA_INSIDE)
        record.python = python
        home = None
        # Its cgroups first: its sandbox shows them (mkdirs and writes in cgroupfs: quick).
        cgroup = self.limits.limit(record)
        if self.access is not None:
            record.user = self.access.user_for(command.app)
            # Its workspace's weights cache: no other workspace's replicas write it.
            weights = self.access.weights_cache(record.user)
            identity = replace(identity, weights_cache_dir=str(weights))
            home = await asyncio.to_thread(
                self.access.prepare,
                record.user,
                replica_id=record.replica_id,
                app_key=command.app,
                bundle_dir=bundle_dir,
                python=python,
            )
            identity = replace(identity, home=str(home), user=record.user.argument())
            if self.sandboxes is not None:
                await self._plan_sandbox(record, command, bundle_dir, python, home, [])
                identity = _as_inside(identity, record.sandbox)
        procs = cgroup.procs_files if cgroup is not None else []
        if snapshot is not None and snapshot.action == "restore" and self.snapshots is not None:

            async def with_gpus(gpus: list[GpuDevice]) -> None:
                if home is not None:
                    await self._plan_sandbox(record, command, bundle_dir, python, home, gpus)

            process = await self.snapshots.restore(
                record, command, snapshot, identity, procs, with_gpus
            )
            if process is not None:
                gpus = self.gpu_slots.held(record.replica_id)
                if self.access is not None and record.user is not None:
                    self.access.grant_gpus(record.user, gpus)
                record.exec_context = self._exec_context(
                    record, bundle_dir, command, gpus, procs, python, process.pid, identity
                )
                return process
        gpus = self.provisioning.take_gpus(record, command)
        if image is not None and gpus:  # its root gets the host's driver (and its env)
            image = await self._with_driver(record, image)
        if self.access is not None and record.user is not None:
            await asyncio.to_thread(self.access.grant_gpus, record.user, gpus)
            if record.sandbox is not None and gpus and home is not None:
                await self._plan_sandbox(record, command, bundle_dir, python, home, gpus)
        pipes = ReplicaPipes.create()
        plan = record.sandbox
        spec = ReplicaSpec(
            bundle_dir=Path(plan.inside(os.path.realpath(bundle_dir))) if plan else bundle_dir,
            entry=command.entry,
            attribute=command.attribute,
            concurrency=command.concurrency,
            label=command.label,
            control_fd=pipes.child_control,
            status_fd=pipes.child_status,
        )
        env = self.provisioning.replica_env(command.env, gpus)
        if image is not None:
            env = image.env(env, command.env)
        env.update(spec.to_env())
        env.update(identity.working_area())
        env["PYTHONUNBUFFERED"] = "1"
        if identity.weights_cache_dir and plan is None:
            env[WEIGHTS_CACHE_DIR_ENV] = identity.weights_cache_dir
        if plan is not None:  # the node's caches, as named inside its sandbox
            env[WEIGHTS_CACHE_DIR_ENV] = identity.weights_cache_dir or ""
            env[VOLUMES_DIR_ENV] = plan.inside(env[VOLUMES_DIR_ENV])
        taking = (snapshot is not None and snapshot.action == "take") or record.retake is not None
        taking = taking and self.snapshots is not None
        # CRIU cannot dump an unprivileged process whose /proc is not its PID namespace's
        # (outside a sandbox), nor one of another uid where CRIU lacks CAP_SYS_RESOURCE:
        # one to be dumped then boots as uid 0 (in a sandbox, without capabilities but
        # those that let it change its uid) and gives up root itself once it reads its
        # identity, after the dump (boot.py); a restored one likewise.
        sandbox = None
        if self.sandboxes is not None and record.sandbox is not None:
            sandbox = self.sandboxes.plan_path(record.replica_id)
        as_root = taking and record.user is not None
        as_root = as_root and (sandbox is None or not self.dumps_other_uids)
        if as_root and sandbox is not None and home is not None:
            # Its working area is root's until its quiet point (boot.py hands it over).
            await asyncio.to_thread(_own_by_root, home)
        if as_root and record.user is not None:
            limited = " without capabilities" if sandbox is not None else ""
            self.note(
                record,
                f"its snapshot phase (imports, enter(snap=True)) runs as uid 0{limited}; "
                f"it serves as uid {record.user.uid}",
            )
        try:
            process = await spawn_cold(
                spec,
                pipes,
                env,
                pid_namespace=self.pid_namespace,
                cgroup_procs=procs,
                python=image.python if image else plan.inside(python) if plan else python,
                boot=image.boot() if image is not None else None,
                user=None if as_root and sandbox is None else record.user,
                sandbox=sandbox,
                root_until_snapshot=as_root and sandbox is not None,
            )
        except BaseException:
            pipes.close_all()
            raise
        pipes.close_child_ends()
        record.exec_context = self._exec_context(
            record, bundle_dir, command, gpus, procs, python, process.pid, identity
        )
        identity = replace(identity, replica_pid=process.pid)
        if taking and self.snapshots is not None:
            # No `replica exec` command in its namespaces while it is dumped: CRIU would
            # find a process outside the tree it dumps. Refused ("still starting") until then.
            context, record.exec_context = record.exec_context, None

            def runs_on() -> None:
                record.exec_context = context

            self.spawn(
                self.snapshots.take_then_release(
                    record, process, command, identity, gpus, dumped=runs_on
                )
            )
        else:
            os.write(pipes.control, identity.to_line())
        return process

    def _exec_context(
        self,
        record: RunningReplica,
        bundle_dir: Path,
        command: wire.StartReplica,
        gpus: list[GpuDevice],
        procs: list[Path],
        python: str,
        pid: int,
        identity: ReplicaIdentity,
    ) -> ExecContext:
        """How `ember replica exec` runs commands in this replica: inside its sandbox, as
        its user, with its working area and caches as it names them."""
        own = dict(identity.working_area())
        if identity.weights_cache_dir:
            own[WEIGHTS_CACHE_DIR_ENV] = identity.weights_cache_dir
        if identity.volumes_dir:
            own[VOLUMES_DIR_ENV] = identity.volumes_dir
        return self.provisioning.exec_context(
            bundle_dir, command, gpus, procs, python, pid, record.user, record.sandbox, own
        )

    async def _plan_sandbox(
        self,
        record: RunningReplica,
        command: wire.StartReplica,
        bundle_dir: Path,
        python: str,
        home: Path,
        gpus: list[GpuDevice],
    ) -> None:
        """The replica's sandbox plan and root folder, with the device nodes of `gpus`
        (and, on an image, the host's driver files)."""
        if self.sandboxes is None or self.access is None:
            return
        image = self.image_runs.get(record.replica_id)
        if image is not None and gpus:
            image = await self._with_driver(record, image)
        environment = self.access.environment_of(python)
        runtime = [*self.access.runtime_paths(python), *([environment] if environment else [])]
        record.sandbox = await asyncio.to_thread(
            self.sandboxes.prepare,
            replica_id=record.replica_id,
            app_key=command.app,
            bundle_dir=bundle_dir,
            runtime=runtime,
            home=home,
            devices=gpu_device_nodes(gpus),
            image=image,
            weights=self.access.weights_cache(record.user) if record.user else None,
            cgroups=record.cgroup.views() if record.cgroup is not None else (),
        )

    async def _image_run(
        self, record: RunningReplica, command: wire.StartReplica
    ) -> ImageRun | None:
        """The image the replica runs on, its root made ready on this node (None
        without image=)."""
        if command.image is None:
            return None
        if self.images is None or self.sandboxes is None:
            raise RuntimeError(
                f"worker {self.config.name} runs no sandbox (it is not root, or runs with "
                "--no-sandbox): replicas of an image= endpoint run only in one"
            )
        image = Image.from_dict(command.image)
        record.image_digest = image.digest  # a user of its root from now on
        if command.requirements:
            self.note(record, "requirements are not installed on an image: use pip_install")
        root = await self.images.root_for(image)
        config = await self.images.config_for(image)
        python = python_in(root)
        if python is None:  # root_for checks it; a lazy root may say so later
            raise RuntimeError(f"image {image.digest[7:19]} has no {runtime_python()}")
        run = await asyncio.to_thread(image_run, root, config, python)
        self.image_runs[record.replica_id] = run
        if self.image_collector is not None:  # a new root may pass the budget
            self.image_collector.collect_soon()
        return run

    async def _with_driver(self, record: RunningReplica, image: ImageRun) -> ImageRun:
        """`image` with the node's GPU driver files (looked for once), kept as the
        replica's: its sandbox plan mounts them, its env finds them."""
        if image.driver is not None:
            return image
        if self._driver is None:
            self._driver = await asyncio.to_thread(node_driver_files)
        if not self._driver.libraries:
            self.note(
                record,
                "no NVIDIA driver library (libcuda.so*) found on this node (ldconfig -p, "
                "the driver's folders): CUDA in the image will not find the driver",
            )
        run = replace(image, driver=self._driver)
        self.image_runs[record.replica_id] = run
        return run

    async def release(self, record: RunningReplica) -> None:
        """What the replica had on the node for itself goes (its process has ended)."""
        if self.image_runs.pop(record.replica_id, None) and self.image_collector is not None:
            self.image_collector.collect_soon()  # its root may be unused now
        if self.access is not None and record.user is not None:
            await asyncio.to_thread(self.access.release, record.replica_id)
        if self.sandboxes is not None and record.sandbox is not None:
            await asyncio.to_thread(self.sandboxes.release, record.replica_id)


def _own_by_root(home: Path) -> None:
    for path in (home, home / "tmp"):
        os.chown(path, 0, 0)


def _as_inside(identity: ReplicaIdentity, plan: SandboxPlan | None) -> ReplicaIdentity:
    """`identity` with the paths it names as the replica's sandbox names them."""
    if plan is None:
        return identity
    return replace(
        identity,
        home=SANDBOX_HOME,
        volumes_dir=_inside_or_none(plan, identity.volumes_dir),
        weights_cache_dir=_inside_or_none(plan, identity.weights_cache_dir),
    )


def _inside_or_none(plan: SandboxPlan, path: str | None) -> str | None:
    return plan.inside(path) if path else None
