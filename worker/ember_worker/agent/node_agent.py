"""The worker agent: one per node. Registers, heartbeats, runs replicas on command.

`Agent` builds the node's parts and wires them together: its channel to the control
plane (control_channel.py) with the heartbeats and log shipping of each session, the
replicas' lifecycle (replicas/), snapshots (node_snapshots.py) and `ember replica exec`
commands (exec_runs.py). The control plane's commands, decoded by the channel, are
dispatched here by their type.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, assert_never

from websockets.asyncio.client import ClientConnection

from ember.wire import messages as wire
from ember_worker import node_probes
from ember_worker.agent.bundles import BundleCache
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.control_channel import ControlChannel
from ember_worker.agent.environments import PythonEnvironments
from ember_worker.agent.exec_runs import ExecRuns
from ember_worker.agent.heartbeats import Heartbeats
from ember_worker.agent.log_shipping import LogShipper
from ember_worker.agent.node_snapshots import NodeSnapshots
from ember_worker.agent.replicas.launch import ReplicaLauncher
from ember_worker.agent.replicas.lifecycle import ReplicaRuns
from ember_worker.agent.replicas.provisioning import ReplicaProvisioning
from ember_worker.agent.replicas.replica_access import ReplicaAccess
from ember_worker.agent.replicas.resource_limits import ResourceLimits
from ember_worker.agent.replicas.sandboxes import ReplicaSandboxes
from ember_worker.agent.running_replica import RunningReplica, running
from ember_worker.agent.volume_copies import VolumeCopyCollector
from ember_worker.gpu_slots import GpuSlots
from ember_worker.gpus.health import GpuHealthWatch
from ember_worker.gpus.scripted_nvml import nvml_module
from ember_worker.gpus.telemetry import GpuTelemetry
from ember_worker.images.build_steps import BUILD_UIDS, StepLimits
from ember_worker.images.layer_store import LayerStore
from ember_worker.images.lazy.lazy_roots import LazyImageRoots
from ember_worker.images.node_builds import NodeImageBuilds
from ember_worker.images.root_collection import ImageRootCollector
from ember_worker.networks.gang_ports import node_loopback
from ember_worker.networks.namespaces import (
    NET_UIDS,
    ReplicaNetworks,
    end_orphans,
    loopback_ports,
)
from ember_worker.processes import seccomp_filter
from ember_worker.processes.cgroups import CPU, MEMORY
from ember_worker.processes.egress_rules import EgressRules
from ember_worker.processes.replica_processes import procfs_tid
from ember_worker.resources import gpu_counts

log = logging.getLogger("ember.worker")


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.stopping = asyncio.Event()
        self.leaving = asyncio.Event()  # asked to stop: the replicas finish first
        # Tells this process's reconnects from another agent that took the same name.
        self.instance = secrets.token_hex(8)
        self.replicas: dict[str, RunningReplica] = {}
        self.tasks: set[asyncio.Task[None]] = set()  # kept here until each is done
        self.logs = LogShipper(config.log_limit)
        self.channel = ControlChannel(
            config,
            stopping=self.stopping,
            leaving=self.leaving,
            hello=self._hello,
            handle=self._handle,
            session_tasks=self._session_tasks,
            after_session=self._clean_node,
        )
        self.bundles = BundleCache(
            config.work_dir / "bundles",
            config.server_url,
            config.token,
            config.ca_cert,
            budget_bytes=config.bundle_cache_bytes,
            in_use=lambda: {r.bundle_digest for r in self.replicas.values() if r.bundle_digest},
        )
        self.execs = ExecRuns(config.name, self.channel.send)  # `ember replica exec` commands
        # A fenced GPU (its health failed) takes no replica until the operator uncordons it.
        self.gpu_health = GpuHealthWatch(config.gpus, nvml_module)
        self.gpu_slots = GpuSlots(config.gpus, fenced=self.gpu_health.fenced)
        # Begun as the worker started (node_probes): over by now, or soon.
        pid_namespace_problem, snapshot_support = node_probes.take().answers()
        if pid_namespace_problem:
            log.warning("replicas run without their own PID namespace: %s", pid_namespace_problem)
        elif config.gpus and (missing := procfs_tid.missing_problem()):
            log.warning("replicas on this node's GPUs will fail to start: %s", missing)
        environments = PythonEnvironments(
            config.work_dir / "environments",
            in_use=lambda: {r.python for r in self.replicas.values() if r.python},
        )
        self.limits = ResourceLimits(
            config.name, self.replicas, self.logs.note, pids_max=config.replica_pids_max
        )
        provisioning = ReplicaProvisioning(config, self.gpu_slots, self.logs.note)
        self.snapshots = NodeSnapshots(
            config,
            snapshot_support,
            provisioning=provisioning,
            note=self.logs.note,
            endpoint_note=self.logs.endpoint_note,
            send=self.channel.send,
            spawn=self._spawn,
        )
        self.heartbeats = Heartbeats(
            config,
            self.replicas,
            self.limits,
            self.snapshots.snapshotter,
            GpuTelemetry(),
            self.gpu_health,
            self.gpu_slots,
        )
        self.volume_copies = VolumeCopyCollector(
            Path(config.volumes_dir), config.volume_cache_bytes, self._app_runs_here
        )
        # Replicas run as their workspace's unprivileged user where the worker is root:
        # the PID namespace's init gives up root for them.
        self.access = ReplicaAccess.for_node(config) if pid_namespace_problem is None else None
        if self.access is None:
            log.warning("replicas run as the worker's own user, not sandboxed")
        self.sandboxes = self._sandboxes(config)
        # Every sandboxed replica gets a network of its own; the control planes it reaches
        # on this node's loopback, and the ports the operator opened, are forwarded from
        # its own.
        self.networks = None
        if self.sandboxes is not None:
            self.networks = ReplicaNetworks(
                config.replica_uids[0],
                loopback_ports([*config.server_urls, config.server_url], config.loopback_ports),
                cgroups=lambda: self.limits.cgroups,
            )
            if problem := self.networks.missing():
                log.error("sandboxed replicas will not start: %s", problem)
        # Images: built here on the control plane's word, and the roots replicas run on.
        self.layer_store = layer_store = LayerStore(config.server_url, config.token, config.ca_cert)
        self.image_builds = NodeImageBuilds(
            layer_store,
            config.work_dir / "images" / "build",
            self.channel.send,
            cache_bytes=config.image_roots_bytes,  # its unpacked layers: a budget of their own
            limits=StepLimits(config.build_step_timeout, self.limits.build_step_cgroup),
        )
        # Lazily mounted where FUSE works, else extracted (images/lazy/lazy_roots.py).
        self.image_roots = LazyImageRoots(
            layer_store, config.work_dir / "images", config.ca_cert, servers=config.server_urls
        )
        self.image_collector = ImageRootCollector(
            self.image_roots,
            config.image_roots_bytes,
            in_use=lambda: {r.image_digest for r in self.replicas.values() if r.image_digest},
        )
        launcher = ReplicaLauncher(
            config,
            bundles=self.bundles,
            environments=environments,
            provisioning=provisioning,
            limits=self.limits,
            gpu_slots=self.gpu_slots,
            snapshots=self.snapshots.replica_images,
            pid_namespace=pid_namespace_problem is None,
            access=self.access,
            sandboxes=self.sandboxes,
            note=self.logs.note,
            spawn=self._spawn,
            images=self.image_roots,
            image_collector=self.image_collector,
            networks=self.networks,
        )
        self.lifecycle = ReplicaRuns(
            config,
            self.replicas,
            launcher=launcher,
            gpu_slots=self.gpu_slots,
            limits=self.limits,
            execs=self.execs,
            logs=self.logs,
            volume_copies=self.volume_copies,
            send=self.channel.send,
        )

    def _sandboxes(self, config: AgentConfig) -> ReplicaSandboxes | None:
        """Sandbox plans for replicas, where they run as their workspace's user and
        libseccomp is at hand (unless --no-sandbox)."""
        if self.access is None:
            return None
        if not config.sandbox:
            log.warning("--no-sandbox: replicas share the node's mounts, with no seccomp filter")
            return None
        problem = seccomp_filter.available()
        if problem is not None:
            log.warning("replicas run without a sandbox: %s", problem)
            return None
        return ReplicaSandboxes(config)

    @property
    def refused(self) -> str | None:
        """Why the control plane will not have this node, once it said so."""
        return self.channel.refused

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_asked)
        await asyncio.to_thread(self.limits.find_tree)
        if self.access is not None:
            await asyncio.to_thread(self.access.prepare_node)
        egress = None
        if self.sandboxes is not None:
            await asyncio.to_thread(self.sandboxes.prepare_node)
            egress = EgressRules(
                self.config.work_dir,
                *self.config.replica_uids,
                cgroup_path=self.limits.cgroups.egress_path,
                also=(BUILD_UIDS.first, BUILD_UIDS.count),
                networks=NET_UIDS.span,  # the build steps' network uid too
            )
            problem = await asyncio.to_thread(egress.install)
            if problem is not None:
                log.warning("replicas may reach link-local addresses: %s", problem)
        # What a killed worker left.
        if self.networks is not None and (ended := await asyncio.to_thread(end_orphans)):
            log.warning("ended %d pasta process(es) a killed worker left", ended)
        self.volume_copies.collect_soon()  # what an earlier run of this worker left
        # Image roots an extraction or a removal cut short left (the rest is collected).
        await asyncio.to_thread(self.image_roots.extracted.clean_partial)
        try:
            await self.channel.serve()
        finally:
            await self.lifecycle.stop_all(grace=5.0)  # any left waiting for a channel
            if self.networks is not None:  # its replicas' have ended with them
                await asyncio.to_thread(self.networks.close)
            await asyncio.to_thread(self.image_roots.close)  # its replicas are gone
            await asyncio.to_thread(self.limits.remove_tree)
            if egress is not None:
                await asyncio.to_thread(egress.remove)
            if self.sandboxes is not None:
                await asyncio.to_thread(self.sandboxes.clean_node)

    def _stop_asked(self) -> None:
        """The first stop signal lets the replicas finish their inputs (the control plane
        sends this node no new ones); a second, or one while not connected, stops now."""
        if self.leaving.is_set() or not self.channel.connected:
            self.stopping.set()
        else:
            self.leaving.set()

    async def _leave_when_asked(self) -> None:
        await self.leaving.wait()
        await self.channel.send(wire.Leaving())
        grace = self.config.shutdown_grace
        log.warning(
            "leaving: %d replica(s) finish their inputs first, for up to %g s "
            "(signal again to stop at once)",
            len(running(self.replicas.values())),
            grace,
        )
        deadline = time.monotonic() + grace
        while running(self.replicas.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.stopping.set()

    def _download_from(self, server_url: str) -> None:
        """Bundles, snapshot images and image layers from `server_url` from now on."""
        self.bundles.server_url = server_url.rstrip("/")
        self.layer_store.server_url = server_url
        if self.snapshots.snapshotter is not None:
            self.snapshots.snapshotter.transfer.server_url = server_url.rstrip("/")

    def _hello(self) -> wire.Hello:
        """The node's registration: what it offers, holds and cannot do. Made as each
        session opens: one opened on another server of the platform (the next of a
        `--server` list) takes the node's downloads there too."""
        self._download_from(self.config.server_url)
        return wire.Hello(
            name=self.config.name,
            cpu=self.config.cpu,
            memory=self.config.memory,
            gpus=gpu_counts(self.config.gpus),
            bundles=self.bundles.cached(),
            snapshots=self.snapshots.hello(),
            memory_limits_problem=self.limits.problem(MEMORY),
            cpu_limits_problem=self.limits.problem(CPU),
            labels=self.config.labels,
            loopback=node_loopback(),
            pid=os.getpid(),
            instance=self.instance,
            replicas=[held for r in self.replicas.values() if (held := r.held_now()) is not None],
        )

    def _session_tasks(self, ws: ClientConnection) -> list[Coroutine[Any, Any, None]]:
        """What runs while a session lasts."""
        return [
            self.heartbeats.send_to(ws.send),
            self.logs.flush_to(ws.send),
            self.limits.watch_memory(),
            self._leave_when_asked(),
        ]

    async def _clean_node(self) -> None:
        """Snapshots in the making belong to a session. Replicas outlive it: each tries
        its channel again for a while (replica/channel.py), the next session's hello
        names them, and the control plane then adopts or stops each; one that finds no
        control plane exits by itself."""
        self.snapshots.abort_all()
        if self.stopping.is_set() or self.leaving.is_set():
            await self.lifecycle.stop_all(grace=5.0)  # this node stops: its replicas too

    def _app_runs_here(self, app: str) -> bool:
        """Whether a replica of `app` runs on this node (asked from a collecting thread)."""
        return any(record.app == app for record in list(self.replicas.values()))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self.tasks.discard)

    def _handle(self, command: wire.ToAgent) -> None:
        """One of the control plane's commands: what it does on this node."""
        match command:
            case wire.StartReplica():
                self._spawn(self.lifecycle.start(command))
            case wire.StopReplica():
                self.lifecycle.stop(command.replica_id, command.grace)
            case wire.UncordonGpu():
                if self.gpu_health.uncordon(command.index):
                    log.info("GPU %d takes replicas again (uncordoned)", command.index)
            case wire.KillReplica():
                self.lifecycle.kill(command.replica_id)
            case wire.PrefetchSnapshot():
                self._spawn(self.snapshots.prefetch(command))
            case wire.ForgetSnapshot():
                self.snapshots.forget(command)
            case wire.RetakeSnapshot():
                self.snapshots.retake_answered(command, self.replicas)
            case wire.Exec():
                self._exec(command)
            case wire.ExecInput() | wire.ExecResize() | wire.ExecKill():
                self.execs.steer(command)
            case wire.BuildImage():
                self._spawn(self.image_builds.build(command))
            case wire.ImagesInUse():
                self.image_collector.told(command.digests)
            case wire.ForgetImage():
                self.image_collector.forget(command.digest)
            case wire.Welcome() | wire.Refused():
                pass  # answers to a hello, read as the session opened
            case _:
                assert_never(command)

    def _exec(self, command: wire.Exec) -> None:
        record = self.replicas.get(command.replica_id)
        context = record.exec_context if record is not None else None
        refusal = self.execs.start(command, context, starting=record is not None)
        if refusal is not None:
            self._spawn(self.channel.send(refusal))
