"""A replica's process started: its bundle and its app's Python environment made ready
and its cgroups made, then restored from a snapshot where asked and possible, else
booted cold (with a snapshot taken at its quiet point where asked). Its identity goes
into its control pipe once it may run on."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
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
from ember_worker.agent.replicas.gang_members import gang_env
from ember_worker.agent.replicas.gpu_driver_files import DriverFiles, node_driver_files
from ember_worker.agent.replicas.image_replicas import CA_INSIDE, ImageRun, image_run
from ember_worker.agent.replicas.provisioning import ReplicaProvisioning
from ember_worker.agent.replicas.replica_access import ReplicaAccess, gpu_device_nodes
from ember_worker.agent.replicas.replica_images import ReplicaSnapshots
from ember_worker.agent.replicas.resource_limits import ResourceLimits
from ember_worker.agent.replicas.sandboxes import CHANNEL_INSIDE, ReplicaSandboxes
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.gpu_slots import GpuSlots
from ember_worker.identity import WEIGHTS_CACHE_DIR_ENV, ReplicaIdentity, ReplicaSpec
from ember_worker.images.image_roots import ImageRoots, python_in, runtime_python
from ember_worker.images.root_collection import ImageRootCollector
from ember_worker.networks.gang_ports import gang_ports
from ember_worker.networks.leases import NetworkLeases
from ember_worker.networks.namespaces import HeldNetwork, ReplicaNetworks
from ember_worker.processes.replica_processes import (
    CAP_SYS_RESOURCE,
    ReplicaPipes,
    ReplicaProcess,
    holds_capability,
    spawn_cold,
)
from ember_worker.processes.replica_users import ReplicaUser
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME, SandboxPlan
from ember_worker.resources import GpuDevice

Spawn = Callable[[Coroutine[Any, Any, None]], None]  # a task the agent keeps until done

log = logging.getLogger("ember.worker")


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
        networks: ReplicaNetworks | None = None,
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
        # A network of its own for every sandboxed replica (None: the node's).
        self.networks = NetworkLeases(networks) if networks is not None else None

    async def launch(self, record: RunningReplica, command: wire.StartReplica) -> ReplicaProcess:
        """Start the replica's process: restored from a snapshot when asked and possible,
        else cold (taking a snapshot at its quiet point when asked). Its identity goes
        into the control pipe once it may run on."""
        plan = await self._plan(record, command)
        snapshot = command.snapshot
        process = None
        if snapshot is not None and snapshot.action == "restore" and self.snapshots is not None:
            process = await self._restore(record, plan)
        if process is None:
            process = await self._boot_cold(record, plan)
        if self.networks is not None and record.sandbox is not None and record.user is not None:
            await self.networks.started(record.replica_id, record.user.uid)
        return process

    async def _plan(self, record: RunningReplica, command: wire.StartReplica) -> LaunchPlan:
        """Everything a start needs before its process, made ready on this node: its
        bundle, its Python (environment or image), its cgroups, its user's working area
        and its sandbox (without GPUs: a restore or a cold boot adds the ones it holds)."""
        record.bundle_digest = command.bundle_digest  # a user of the folder from now on
        record.gang = command.gang
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
        if command.snapshot_note:
            self.note(record, command.snapshot_note)
        if self.access is not None:
            record.user = self.access.user_for(command.app)
        # The app's requirements.txt, installed once per node: before a restore too, as
        # the image maps the environment's files.
        image = await self._image_run(record, command)
        if image is None:
            if self.access is not None and record.user is not None:
                # Its install runs as the workspace's user, which reads the bundle.
                await asyncio.to_thread(self.access.open_bundle, record.user, bundle_dir)
            python = await self.environments.python_for(
                bundle_dir, lambda text: self.note(record, text), command.requirements, record.user
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
        if self.access is not None and record.user is not None:
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
        plan = LaunchPlan(
            command=command,
            bundle_dir=bundle_dir,
            identity=identity,
            python=python,
            image=image,
            cgroup_procs=tuple(cgroup.procs_files if cgroup is not None else ()),
            home=home,
        )
        if home is not None and self.sandboxes is not None:
            await self._plan_sandbox(record, plan, [])
            plan = replace(plan, identity=_as_inside(identity, record.sandbox))
            if self.networks is not None:
                # The control plane's abstract socket is the node's network's: its replicas
                # use the socket file mounted for them, else TLS, at the loopback port
                # their network forwards.
                inside = CHANNEL_INSIDE if self.config.replica_channel_socket else None
                plan = replace(plan, identity=replace(plan.identity, channel_socket=inside))
        return plan

    async def _network(
        self, record: RunningReplica, cgroup_procs: tuple[Path, ...]
    ) -> HeldNetwork | None:
        """The replica's network namespace (None: it has the node's); a gang member's
        forwards its gang's ports."""
        if self.networks is None or record.sandbox is None or record.user is None:
            return None
        gang = record.gang
        ports = None if gang is None else gang_ports(gang)
        return await self.networks.take(record.replica_id, record.user.uid, cgroup_procs, ports)

    async def _restore(self, record: RunningReplica, plan: LaunchPlan) -> ReplicaProcess | None:
        """The replica restored from its snapshot; None where it cannot be (it boots cold)."""
        assert self.snapshots is not None and plan.command.snapshot is not None

        async def with_gpus(gpus: list[GpuDevice]) -> None:
            if plan.home is not None:
                await self._plan_sandbox(record, plan, gpus)

        network = await self._network(record, plan.cgroup_procs)
        process = await self.snapshots.restore(
            record,
            plan.command,
            plan.command.snapshot,
            plan.identity,
            list(plan.cgroup_procs),
            with_gpus,
            network.fd if network is not None else None,
        )
        if process is None:
            return None
        gpus = self.gpu_slots.held(record.replica_id)
        if self.access is not None and record.user is not None:
            self.access.grant_gpus(record.user, gpus)
        record.exec_context = self._exec_context(record, plan, gpus, process.pid)
        return process

    async def _boot_cold(self, record: RunningReplica, plan: LaunchPlan) -> ReplicaProcess:
        """The replica booted from its bundle (its snapshot taken at its quiet point when
        asked); its identity written once it may run on."""
        command, image = plan.command, plan.image
        gpus = self.provisioning.take_gpus(record, command)
        if image is not None and gpus:  # its root gets the host's driver (and its env)
            image = await self._with_driver(record, image)
        if self.access is not None and record.user is not None:
            await asyncio.to_thread(self.access.grant_gpus, record.user, gpus)
            if record.sandbox is not None and gpus and plan.home is not None:
                await self._plan_sandbox(record, plan, gpus)
        pipes = ReplicaPipes.create()
        sandbox = record.sandbox
        spec = ReplicaSpec(
            bundle_dir=(
                Path(sandbox.inside(os.path.realpath(plan.bundle_dir)))
                if sandbox
                else plan.bundle_dir
            ),
            entry=command.entry,
            attribute=command.attribute,
            concurrency=command.concurrency,
            label=command.label,
            control_fd=pipes.child_control,
            status_fd=pipes.child_status,
        )
        env = self._cold_env(plan, image, spec, gpus, sandbox)
        snapshot = command.snapshot
        taking = (snapshot is not None and snapshot.action == "take") or record.retake is not None
        taking = taking and self.snapshots is not None
        plan_file = None
        if self.sandboxes is not None and sandbox is not None:
            plan_file = self.sandboxes.plan_path(record.replica_id)
        who = run_as(
            record.user,
            taking=taking,
            sandboxed=plan_file is not None,
            dumps_other_uids=self.dumps_other_uids,
        )
        if who.root_until_snapshot and plan.home is not None:
            # Its working area is root's until its quiet point (boot.py hands it over).
            await asyncio.to_thread(_own_by_root, plan.home)
        if who.as_root and record.user is not None:
            limited = " without capabilities" if plan_file is not None else ""
            self.note(
                record,
                f"its snapshot phase (imports, enter(snap=True)) runs as uid 0{limited}; "
                f"it serves as uid {record.user.uid}",
            )
        python = plan.python
        network = await self._network(record, plan.cgroup_procs)
        try:
            process = await spawn_cold(
                spec,
                pipes,
                env,
                pid_namespace=self.pid_namespace,
                cgroup_procs=plan.cgroup_procs,
                python=image.python if image else sandbox.inside(python) if sandbox else python,
                boot=image.boot() if image is not None else None,
                user=who.user,
                sandbox=plan_file,
                root_until_snapshot=who.root_until_snapshot,
                net_ns=network.fd if network is not None else None,
            )
        except BaseException:
            pipes.close_all()
            raise
        pipes.close_child_ends()
        record.exec_context = self._exec_context(record, plan, gpus, process.pid)
        identity = replace(plan.identity, replica_pid=process.pid)
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

    def _cold_env(
        self,
        plan: LaunchPlan,
        image: ImageRun | None,
        spec: ReplicaSpec,
        gpus: list[GpuDevice],
        sandbox: SandboxPlan | None,
    ) -> dict[str, str]:
        """A cold replica's environment: its own variables over the node's base
        (provisioning.replica_env), its image's, its runtime's, its caches as it names them."""
        identity = plan.identity
        env = self.provisioning.replica_env(plan.command.env, gpus)
        if image is not None:
            env = image.env(env, plan.command.env)
        env.update(spec.to_env())
        env.update(identity.working_area())
        env["PYTHONUNBUFFERED"] = "1"
        if plan.command.gang is not None:  # after its own variables: these are the platform's
            env.update(gang_env(plan.command.gang))
        if identity.weights_cache_dir and sandbox is None:
            env[WEIGHTS_CACHE_DIR_ENV] = identity.weights_cache_dir
        if sandbox is not None:  # the node's caches, as named inside its sandbox
            env[WEIGHTS_CACHE_DIR_ENV] = identity.weights_cache_dir or ""
            env[VOLUMES_DIR_ENV] = sandbox.inside(env[VOLUMES_DIR_ENV])
        return env

    def _exec_context(
        self, record: RunningReplica, plan: LaunchPlan, gpus: list[GpuDevice], pid: int
    ) -> ExecContext:
        """How `ember replica exec` runs commands in this replica: inside its sandbox, as
        its user, with its working area and caches as it names them."""
        identity = plan.identity
        own = dict(identity.working_area())
        if identity.weights_cache_dir:
            own[WEIGHTS_CACHE_DIR_ENV] = identity.weights_cache_dir
        if identity.volumes_dir:
            own[VOLUMES_DIR_ENV] = identity.volumes_dir
        return self.provisioning.exec_context(
            plan.bundle_dir,
            plan.command,
            gpus,
            list(plan.cgroup_procs),
            plan.python,
            pid,
            record.user,
            record.sandbox,
            own,
        )

    async def _plan_sandbox(
        self, record: RunningReplica, plan: LaunchPlan, gpus: list[GpuDevice]
    ) -> None:
        """The replica's sandbox plan and root folder, with the device nodes of `gpus`
        (and, on an image, the host's driver files)."""
        if self.sandboxes is None or self.access is None or plan.home is None:
            return
        image = self.image_runs.get(record.replica_id)
        if image is not None and gpus:
            image = await self._with_driver(record, image)
        environment = self.access.environment_of(plan.python)
        runtime = [*self.access.runtime_paths(plan.python), *([environment] if environment else [])]
        record.sandbox = await asyncio.to_thread(
            self.sandboxes.prepare,
            replica_id=record.replica_id,
            app_key=plan.command.app,
            bundle_dir=plan.bundle_dir,
            runtime=runtime,
            home=plan.home,
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
        if self.networks is not None and record.user is not None:
            await self.networks.release(record.replica_id, record.user.uid)
        if self.image_runs.pop(record.replica_id, None) and self.image_collector is not None:
            self.image_collector.collect_soon()  # its root may be unused now
        if self.access is not None and record.user is not None:
            await asyncio.to_thread(self.access.release, record.replica_id)
        if self.sandboxes is not None and record.sandbox is not None:
            await asyncio.to_thread(self.sandboxes.release, record.replica_id)


@dataclass(frozen=True)
class LaunchPlan:
    """What a replica's start is decided with, made ready before its process exists
    (ReplicaLauncher._plan): then it is restored or booted cold from it."""

    command: wire.StartReplica
    bundle_dir: Path  # the node's path of its extracted bundle
    identity: ReplicaIdentity  # as the replica names things (inside its sandbox)
    python: str  # the node's path of its interpreter (an environment's, or the worker's)
    image: ImageRun | None  # the image it runs on (image=), its root ready here
    cgroup_procs: tuple[Path, ...]  # the cgroup.procs files it joins
    home: Path | None  # its working area (None: it runs as the worker's user)


@dataclass(frozen=True)
class RunAs:
    """Who a cold replica's process is until it serves."""

    user: ReplicaUser | None  # the PID namespace's init becomes it (None: stays as started)
    root_until_snapshot: bool  # uid 0 without capabilities, in its sandbox, until its dump
    as_root: bool  # its snapshot phase runs as uid 0 (it gives up root itself after)


def run_as(
    user: ReplicaUser | None, *, taking: bool, sandboxed: bool, dumps_other_uids: bool
) -> RunAs:
    """Who a cold replica runs as. CRIU cannot dump an unprivileged process whose /proc
    is not its PID namespace's (outside a sandbox), nor one of another uid where CRIU
    lacks CAP_SYS_RESOURCE: one to be dumped then boots as uid 0 (in a sandbox, without
    capabilities but those that let it change its uid) and gives up root itself once it
    reads its identity, after the dump (boot.py); a restored one likewise."""
    as_root = taking and user is not None and (not sandboxed or not dumps_other_uids)
    if as_root and not sandboxed:
        return RunAs(user=None, root_until_snapshot=False, as_root=True)
    return RunAs(user=user, root_until_snapshot=as_root, as_root=as_root)


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
