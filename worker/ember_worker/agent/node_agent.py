"""The worker agent: one per node. Registers, heartbeats, runs replicas on command."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from ember.state.volumes import VOLUMES_DIR_ENV
from ember.wire.labels import split_label
from ember.wire.limits import MAX_LOG_BATCH_BYTES
from ember_worker.agent.bundles import BundleCache
from ember_worker.agent.environments import PythonEnvironments
from ember_worker.agent.exec_runs import ExecRuns
from ember_worker.agent.gpu_telemetry import GpuTelemetry
from ember_worker.agent.replica_exec import ExecContext
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.agent.volume_copies import collect_garbage as collect_volume_copies
from ember_worker.channel_url import open_channel
from ember_worker.gpu_slots import VISIBLE_DEVICES_ENV, GpuSlots, visible_devices
from ember_worker.identity import (
    WEIGHTS_CACHE_BYTES_ENV,
    WEIGHTS_CACHE_DIR_ENV,
    ReplicaIdentity,
    ReplicaSpec,
    secret_env,
)
from ember_worker.processes.cgroups import CPU, MEMORY, CgroupTree, ReplicaCgroup, find_tree
from ember_worker.processes.exits import describe_exit, oom_kill_count
from ember_worker.processes.memory_use import over_request, tree_bytes
from ember_worker.processes.replica_processes import (
    ReplicaPipes,
    ReplicaProcess,
    open_reader,
    pid_namespaces_available,
    procfs_tid,
    spawn_cold,
)
from ember_worker.replica.call_tagged_output import split_tag
from ember_worker.resources import GpuDevice, gpu_counts
from ember_worker.snapshots.criu import Snapshotter, detect_support
from ember_worker.snapshots.huge_pages import huge_pages_problem
from ember_worker.snapshots.replica_images import ReplicaSnapshots
from ember_worker.weights.disk_cache import DiskCache, objects_dir

log = logging.getLogger("ember.worker")


def refusal_reason(body: bytes | None) -> str:
    """Why the control plane refused the channel's handshake, from its answer's JSON
    error; an older control plane answers with no body."""
    with contextlib.suppress(ValueError, TypeError, KeyError):
        message = json.loads(body or b"")["error"]["message"]
        if isinstance(message, str) and message:
            return message
    return "it is wrong, revoked or expired, or not a worker token"


HEARTBEAT_SECONDS = 2.0
MEMORY_CHECK_SECONDS = 5.0  # how often replicas' memory use is held against their request
# Volume copies are walked at most this often: replicas with max_inputs=1 exit per input.
VOLUME_COLLECTION_SECONDS = 5.0
LOG_FLUSH_SECONDS = 0.1
WEIGHTS_DIR = "weights"  # the node's weights cache, in the work dir
# Never hand these to user code.
SECRET_ENV = ("EMBER_WORKER_TOKEN", "EMBER_TOKEN")
REPLICA_PID_ENV = "EMBER_REPLICA_PID"  # in `ember replica exec` commands


class NodeRefused(Exception):
    """The control plane said why it will not take this node (its answer to the hello)."""


@dataclass
class AgentConfig:
    server_url: str
    token: str
    ca_cert: str | None
    work_dir: Path
    name: str
    cpu: float
    memory: int
    gpus: list[GpuDevice] = field(default_factory=list)  # detected or declared (--gpus)
    snapshot_budget_bytes: int = 20 * 1024**3  # node-local snapshot images
    weights_cache_bytes: int = 50 * 1024**3  # node-local weights chunks, shared by replicas
    volume_cache_bytes: int = 50 * 1024**3  # node-local ember.Volume copies
    # Restored replicas run before all their memory is back (where the kernel allows).
    # Opt-in: should CRIU's lazy-pages daemon die, the replica would read zeroed pages in
    # the moment before it is killed; eager restores cannot fail that way.
    lazy_restore: bool = False
    # Restored replicas' dense memory goes into 2 MiB pages (huge_pages.py). Opt-in: a
    # win where the kernel has huge pages at hand, a loss on VMs whose host takes free
    # memory back.
    huge_pages: bool = False
    fetch_ahead: bool = True  # published images, before a replica here needs them
    # The control plane's Unix socket, when it runs on this node: channels skip TCP and TLS.
    channel_socket: str | None = None
    labels: dict[str, str] = field(default_factory=dict)  # for endpoints' node_labels=
    # On SIGTERM, how long replicas may take to finish their inputs before they are
    # stopped anyway (a second signal stops them at once).
    shutdown_grace: float = 30.0

    @property
    def volumes_dir(self) -> str:
        """The node's ember.Volume copies, shared by its replicas of each app."""
        return str(self.work_dir / "volumes")


def log_batches(entries: list[dict[str, Any]], max_bytes: int) -> Iterator[list[dict[str, Any]]]:
    """The entries in order, cut into batches of about `max_bytes` of text at most, so
    that a replica printing fast never makes one channel message too large."""
    batch: list[dict[str, Any]] = []
    size = 0
    for entry in entries:
        entry_size = len(entry["text"]) + 200  # the text and its fields, roughly
        if batch and size + entry_size > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry_size
    if batch:
        yield batch


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.bundles = BundleCache(
            config.work_dir / "bundles", config.server_url, config.token, config.ca_cert
        )
        self.replicas: dict[str, RunningReplica] = {}
        self.log_buffer: list[dict[str, Any]] = []
        self.ws: ClientConnection | None = None
        self.stopping = asyncio.Event()
        self.leaving = asyncio.Event()  # asked to stop: the replicas finish first
        self.refused: str | None = None  # why the control plane will not have this node
        # Tells this process's reconnects from another agent that took the same name.
        self.instance = secrets.token_hex(8)
        self.starting: set[asyncio.Task[None]] = set()
        self.execs = ExecRuns(config.name, self._send)  # `ember replica exec` commands
        self.gpu_telemetry = GpuTelemetry()
        self.gpu_slots = GpuSlots(config.gpus)
        self.pid_namespace_problem = pid_namespaces_available()
        if self.pid_namespace_problem:
            log.warning(
                "replicas run without their own PID namespace: %s", self.pid_namespace_problem
            )
        elif self.config.gpus and (missing := procfs_tid.missing_problem()):
            log.warning("replicas on this node's GPUs will fail to start: %s", missing)
        self.snapshot_support = detect_support(self.pid_namespace_problem)
        self.environments = PythonEnvironments(
            config.work_dir / "environments",
            in_use=lambda: {r.python for r in self.replicas.values() if r.python},
        )
        # One collection of volume copies at a time; an exit during one asks for another.
        self.volume_collection: asyncio.Task[None] | None = None
        self.volume_collection_again = False
        self.volume_collected_at = -VOLUME_COLLECTION_SECONDS  # time.monotonic() of the last
        # Where replicas' memory_limit= and cpu_limit= are enforced: made when run() starts.
        self.cgroups = CgroupTree.unavailable("the worker has not started yet")
        self.snapshotter: Snapshotter | None = None
        if not self.snapshot_support.problem:
            try:
                self.snapshotter = Snapshotter(
                    self.snapshot_support,
                    config.work_dir / "snapshots",
                    config.server_url,
                    config.token,
                    config.ca_cert,
                    config.snapshot_budget_bytes,
                    same_on_every_node=[config.work_dir],  # bundles unpack at the same path
                    weights_objects=objects_dir(config.work_dir / WEIGHTS_DIR),
                )
            except ValueError as exc:  # a bad setting: said where snapshots-off reasons are
                self.snapshot_support = replace(self.snapshot_support, problem=str(exc))
        if self.snapshot_support.problem:
            log.warning("snapshots are off on this node: %s", self.snapshot_support.problem)
        # Restores into huge pages, where asked for and the kernel has them.
        self.huge_pages = config.huge_pages and self.snapshotter is not None
        if self.huge_pages and (problem := huge_pages_problem()):
            log.warning("restores use 4 KiB pages: %s", problem)
            self.huge_pages = False
        self.snapshots: ReplicaSnapshots | None = None
        if self.snapshotter is not None:
            self.snapshots = ReplicaSnapshots(
                self.snapshotter,
                lazy_restore=config.lazy_restore,
                huge_pages=self.huge_pages,
                gpu_node=bool(config.gpus),
                note=self._note,
                send=self._send,
                spawn=self._spawn,
                take_gpus=self._take_gpus,
                replica_env=lambda command: self._replica_env(command, ()),
            )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_asked)
        await asyncio.to_thread(self._find_cgroups)
        self._collect_volume_copies_soon()  # what an earlier run of this worker left
        try:
            await self._serve()
        finally:
            await asyncio.to_thread(self.cgroups.remove)

    def _stop_asked(self) -> None:
        """The first stop signal lets the replicas finish their inputs (the control plane
        sends this node no new ones); a second, or one while not connected, stops now."""
        if self.leaving.is_set() or self.ws is None:
            self.stopping.set()
        else:
            self.leaving.set()

    async def _leave_when_asked(self) -> None:
        await self.leaving.wait()
        await self._send({"type": "leaving"})
        grace = self.config.shutdown_grace
        log.warning(
            "leaving: %d replica(s) finish their inputs first, for up to %g s "
            "(signal again to stop at once)",
            len(self.replicas),
            grace,
        )
        deadline = time.monotonic() + grace
        while self.replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.stopping.set()

    def _find_cgroups(self) -> None:
        if os.geteuid() == 0:
            self.cgroups = find_tree()
        else:
            self.cgroups = CgroupTree.unavailable("the worker does not run as root")
        for controller in (MEMORY, CPU):
            problem = self.cgroups.problem(controller)
            if problem:
                log.warning("%s_limit= cannot be enforced on this node: %s", controller, problem)

    async def _serve(self) -> None:
        backoff = 0.2
        while not self.stopping.is_set():
            session = asyncio.ensure_future(self._session())
            stop = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait({session, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not session.done():
                session.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await session
                    backoff = 0.2
                except InvalidStatus as exc:
                    if exc.response.status_code in (401, 403):
                        # Its token will not change by itself: trying again cannot help.
                        self.refused = (
                            "the control plane refused this worker's token (HTTP "
                            f"{exc.response.status_code}): {refusal_reason(exc.response.body)}; "
                            "start the worker with a worker token (`ember token create "
                            "--scope worker`)"
                        )
                        log.error("%s", self.refused)
                        self.stopping.set()
                    else:
                        log.error("the control plane refused this worker: %s", exc)
                except NodeRefused as exc:
                    # It may pass: a namesake that is going away, say.
                    log.error("the control plane refused this worker: %s; trying again", exc)
                    backoff = 5.0
                except (OSError, WebSocketException, TimeoutError) as exc:
                    log.warning("control plane unreachable (%s); retrying", exc)
            # Replicas belong to a session: a new session starts from a clean node.
            if self.snapshotter is not None:
                self.snapshotter.abort_all()
            await self._stop_all(grace=5.0)
            if self.leaving.is_set():
                self.stopping.set()  # the control plane went away while this node left
            if not self.stopping.is_set():
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _session(self) -> None:
        async with open_channel(
            self.config.server_url,
            "/v1/workers/channel",
            channel_socket=self.config.channel_socket,
            ca_cert=self.config.ca_cert,
            additional_headers={"Authorization": f"Bearer {self.config.token}"},
            max_size=None,
            ping_interval=None,
            open_timeout=10,
        ) as ws:
            hello = {
                "type": "hello",
                "name": self.config.name,
                "cpu": self.config.cpu,
                "memory": self.config.memory,
                "gpus": gpu_counts(self.config.gpus),
                "bundles": self.bundles.cached(),
                "snapshots": {
                    **self.snapshot_support.hello(),
                    "lazy_restore": self.config.lazy_restore and self.snapshot_support.lazy_pages,
                    "huge_pages": self.huge_pages,
                },
                "memory_limits_problem": self.cgroups.problem(MEMORY),
                "cpu_limits_problem": self.cgroups.problem(CPU),
                "labels": self.config.labels,
                "pid": os.getpid(),
                "instance": self.instance,
            }
            await ws.send(json.dumps(hello))
            welcome = json.loads(await ws.recv())
            if welcome.get("type") == "refused":
                raise NodeRefused(str(welcome.get("reason") or "refused"))
            log.info("registered as %s", welcome.get("worker_id"))
            self.ws = ws
            background = [
                asyncio.ensure_future(self._heartbeat(ws)),
                asyncio.ensure_future(self._flush_logs(ws)),
                asyncio.ensure_future(self._watch_memory()),
                asyncio.ensure_future(self._leave_when_asked()),
            ]
            try:
                async for message in ws:
                    self._handle(json.loads(message))
            except ConnectionClosed:
                pass
            finally:
                self.ws = None
                for task in background:
                    task.cancel()

    async def _send(self, payload: dict[str, Any]) -> None:
        if self.ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await self.ws.send(json.dumps(payload))

    async def _watch_memory(self) -> None:
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
                    self._note(record, note)

    async def _heartbeat(self, ws: ClientConnection) -> None:
        sent_cached: list[tuple[str, str]] | None = None  # new connection: sent at once
        sent_weights: dict[str, int] | None = None
        weights_cache = DiskCache(
            self.config.work_dir / WEIGHTS_DIR, self.config.weights_cache_bytes
        )
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            beat: dict[str, Any] = {"type": "heartbeat"}
            gpus = await asyncio.to_thread(self.gpu_telemetry.sample)
            if gpus:
                beat["gpus"] = [sample.to_dict() for sample in gpus]
            memory = {
                replica_id: record.memory_bytes
                for replica_id, record in self.replicas.items()
                if record.memory_bytes is not None
            }
            if memory:
                beat["replica_memory"] = memory
            throttled = self._cpu_throttled_seconds()
            if throttled:
                beat["replica_cpu_throttled"] = throttled
            if self.snapshotter is not None:
                cached = await asyncio.to_thread(self.snapshotter.cached)
                if cached != sent_cached:  # the images this node holds, when they change
                    beat["cached_snapshots"] = [list(pair) for pair in cached]
                    sent_cached = cached
            weights = await asyncio.to_thread(weights_cache.holdings)
            if weights != sent_weights:  # bytes of weights by URL, when they change
                beat["cached_weights"] = weights
                sent_weights = weights
            await ws.send(json.dumps(beat))

    def _cpu_throttled_seconds(self) -> dict[str, float]:
        """Seconds each replica with a cpu_limit= has waited for CPU time so far (a
        read of a small cgroupfs file each)."""
        waited = {}
        for replica_id, record in list(self.replicas.items()):
            throttling = record.cgroup.cpu_throttling() if record.cgroup is not None else None
            if throttling is not None:
                waited[replica_id] = throttling.throttled_seconds
        return waited

    async def _flush_logs(self, ws: ClientConnection) -> None:
        while True:
            await asyncio.sleep(LOG_FLUSH_SECONDS)
            if self.log_buffer:
                entries, self.log_buffer = self.log_buffer, []
                for batch in log_batches(entries, MAX_LOG_BATCH_BYTES):
                    await ws.send(json.dumps({"type": "logs", "entries": batch}))

    def _handle(self, command: dict[str, Any]) -> None:
        kind = command.get("type")
        if kind == "start_replica":
            task = asyncio.ensure_future(self._start_replica(command))
            self.starting.add(task)  # keep a reference until it is done
            task.add_done_callback(self.starting.discard)
        elif kind == "stop_replica":
            self._stop_replica(str(command["replica_id"]), float(command.get("grace", 30)))
        elif kind == "kill_replica":
            replica = self.replicas.get(str(command["replica_id"]))
            if replica is not None:
                replica.signal(signal.SIGKILL)
        elif kind == "prefetch_snapshot":
            self._spawn(self._prefetch_snapshot(command))
        elif kind == "forget_snapshot" and self.snapshotter is not None:
            self.snapshotter.forget_key(str(command["key"]))
        elif kind == "retake_snapshot" and self.snapshots is not None:
            self.snapshots.retake_answered(self.replicas.get(str(command["replica_id"])), command)
        elif kind == "exec":
            record = self.replicas.get(str(command["replica_id"]))
            context = record.exec_context if record is not None else None
            refusal = self.execs.start(command, context, starting=record is not None)
            if refusal is not None:
                self._spawn(self._send(refusal))
        elif kind in ("exec_kill", "exec_input", "exec_resize"):
            self.execs.steer(command)

    async def _prefetch_snapshot(self, command: dict[str, Any]) -> None:
        """Fetch a newly published image into this node's cache before a replica here
        needs it (`Snapshotter.fetch_ahead`), and say so in its endpoint's log."""
        if self.snapshotter is None or not self.config.fetch_ahead:
            return
        key, label = str(command["key"]), str(command.get("label", ""))
        image_id = str(command.get("image_id") or "")
        size = int(command.get("raw_size") or 0)
        seconds = await self.snapshotter.fetch_ahead(key, image_id, size)
        if seconds is not None:
            self._endpoint_note(
                label,
                f"snapshot {key[:12]} fetched ahead onto worker {self.config.name} in "
                f"{seconds:.2f} s: replicas starting there restore without downloading it",
            )
        if self.snapshots is not None:  # and the weights it maps, had earlier or just now
            cache = DiskCache(self.config.work_dir / WEIGHTS_DIR, self.config.weights_cache_bytes)
            weights = await self.snapshots.fetch_weights_ahead(command, cache.room_for)
            if weights is not None:
                self._endpoint_note(label, f"worker {self.config.name}: {weights}")

    def _endpoint_note(self, label: str, text: str) -> None:
        """A line of this node's into its log and into the endpoint's, beside the
        platform's lines."""
        log.info("%s", text)
        parts = split_label(label)
        if parts is not None:
            app, endpoint = parts
            entry = {"ts": time.time(), "app": app, "endpoint": endpoint, "stream": "ember"}
            self.log_buffer.append({**entry, "text": text})

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self.starting.add(task)  # keep a reference until it is done
        task.add_done_callback(self.starting.discard)

    def _stop_replica(self, replica_id: str, grace: float) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return
        replica.signal(signal.SIGTERM)  # the runtime drains, runs exit hooks, exits
        loop = asyncio.get_running_loop()
        replica.kill_timer = loop.call_later(grace, self._kill_after_grace, replica, grace)

    def _kill_after_grace(self, replica: RunningReplica, grace: float) -> None:
        """SIGKILL for a replica still there `grace` s after SIGTERM, said in its log: its
        exit hooks may not have run to the end, and the user should know why."""
        cause = (
            f"still running {grace:g} s after it was asked to stop (an input or an "
            "@ember.exit hook did not finish): killed with SIGKILL"
        )
        self._note(replica, cause)
        replica.exit_cause = f"stopped, {cause}"
        replica.signal(signal.SIGKILL)

    async def _start_replica(self, command: dict[str, Any]) -> None:
        replica_id = str(command["replica_id"])
        record = RunningReplica(replica_id, str(command["app"]), str(command["endpoint"]))
        if isinstance(command.get("memory"), int):
            record.memory_mib = command["memory"]
        if isinstance(command.get("memory_limit"), int):
            record.memory_limit_mib = command["memory_limit"]
        if isinstance(command.get("cpu_limit"), int | float):
            record.cpu_limit = float(command["cpu_limit"])
        self.replicas[replica_id] = record
        try:
            process = await self._launch(record, command)
        except Exception as exc:
            reason = str(exc)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                work_dir = self.config.work_dir
                reason = f"worker {self.config.name} has no disk space left in {work_dir}"
            log.error("replica %s: %s", replica_id, reason)
            self.replicas.pop(replica_id, None)
            self.gpu_slots.release(replica_id)
            if record.cgroup is not None:
                await asyncio.to_thread(record.cgroup.remove)
            await self._report_exit(replica_id, None, f"cannot start: {reason}")
            return
        record.process = process
        if record.stop_requested is not None:
            process.signal(record.stop_requested)
        readers = [
            asyncio.ensure_future(self._pipe_lines(record, process.pipes.stdout, "stdout")),
            asyncio.ensure_future(self._pipe_lines(record, process.pipes.stderr, "stderr")),
        ]
        returncode = await process.wait()
        process.returncode = returncode
        await asyncio.gather(*readers, return_exceptions=True)
        process.pipes.close_all()
        if record.kill_timer is not None:
            record.kill_timer.cancel()
        self.replicas.pop(replica_id, None)
        self.gpu_slots.release(replica_id)  # the process is gone, and its GPU memory with it
        await self.execs.end_for(replica_id)
        self._collect_volume_copies_soon()  # its app's copies may be unused now
        over_limit = None
        if record.cgroup is not None:
            if record.cgroup.oom_kills():
                over_limit = record.cgroup.memory_limit_mib
            self._note_cpu_throttling(record)
            if not await asyncio.to_thread(record.cgroup.remove):
                where = ", ".join(map(str, record.cgroup.paths))
                log.warning("replica %s: its cgroups %s stay busy", replica_id, where)
        detail = record.exit_cause or describe_exit(
            returncode,
            killed_by_agent=record.killed,
            oom_kills_before=record.oom_kills_at_start,
            oom_kills_after=oom_kill_count(),
            stderr_tail=record.last_words(time.monotonic()),
            memory_mib=record.memory_mib,
            over_limit_mib=over_limit,
        )
        await self._report_exit(replica_id, returncode, detail)

    async def _launch(self, record: RunningReplica, command: dict[str, Any]) -> ReplicaProcess:
        """Start the replica's process: restored from a snapshot when asked and possible,
        else cold (taking a snapshot at its quiet point when asked). Its identity goes
        into the control pipe once it may run on."""
        bundle_dir = await self.bundles.ensure(str(command["bundle_digest"]))
        identity = ReplicaIdentity(
            replica_id=record.replica_id,
            token=str(command["token"]),
            call_token=str(command.get("call_token", "")),
            server_url=self.config.server_url,
            ca_cert=self.config.ca_cert,
            channel_socket=self.config.channel_socket,
            volumes_dir=self.config.volumes_dir,
            weights_cache_dir=str(self.config.work_dir / WEIGHTS_DIR),
            weights_cache_bytes=self.config.weights_cache_bytes,
        )
        snapshot = command.get("snapshot") or {}
        if command.get("snapshot_note"):
            self._note(record, str(command["snapshot_note"]))
        # The app's requirements.txt, installed once per node: before a restore too, as
        # the image maps the environment's files.
        python = await self.environments.python_for(
            bundle_dir,
            lambda text: self._note(record, text),
            [str(line) for line in command.get("requirements") or []],
        )
        record.python = python
        cgroup = self._limit_resources(record)  # mkdirs and writes in cgroupfs: quick
        procs = cgroup.procs_files if cgroup is not None else []
        if snapshot.get("action") == "restore" and self.snapshots is not None:
            process = await self.snapshots.restore(record, command, identity, procs)
            if process is not None:
                gpus = self.gpu_slots.held(record.replica_id)
                record.exec_context = self._exec_context(
                    bundle_dir, command, gpus, procs, python, process.pid
                )
                return process
        gpus = self._take_gpus(record, command)
        pipes = ReplicaPipes.create()
        spec = ReplicaSpec(
            bundle_dir=bundle_dir,
            entry=str(command["entry"]),
            attribute=str(command["attribute"]),
            concurrency=int(command["concurrency"]),
            label=str(command["label"]),
            control_fd=pipes.child_control,
            status_fd=pipes.child_status,
        )
        env = self._replica_env(command, gpus)
        env.update(spec.to_env())
        env["PYTHONUNBUFFERED"] = "1"
        try:
            process = await spawn_cold(
                spec,
                pipes,
                env,
                pid_namespace=self.pid_namespace_problem is None,
                cgroup_procs=procs,
                python=python,
            )
        except BaseException:
            pipes.close_all()
            raise
        pipes.close_child_ends()
        record.exec_context = self._exec_context(
            bundle_dir, command, gpus, procs, python, process.pid
        )
        taking = snapshot.get("action") == "take" or record.retake is not None
        if taking and self.snapshots is not None:
            self._spawn(self.snapshots.take_then_release(record, process, command, identity, gpus))
        else:
            os.write(pipes.control, identity.to_line())
        return process

    def _collect_volume_copies_soon(self) -> None:
        if self.volume_collection is not None and not self.volume_collection.done():
            self.volume_collection_again = True
            return
        self.volume_collection = asyncio.ensure_future(self._collect_volume_copies())

    async def _collect_volume_copies(self) -> None:
        """Keep the node's volume copies within their budget: those of apps that have no
        replica here go, the least recently synced first."""
        root = Path(self.config.volumes_dir)
        budget = self.config.volume_cache_bytes

        def busy(app: str) -> bool:  # asked from the collecting thread, under a copy's lock
            return any(record.app == app for record in list(self.replicas.values()))

        while True:
            pause = self.volume_collected_at + VOLUME_COLLECTION_SECONDS - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)  # exits meanwhile are covered by the walk after it
            self.volume_collection_again = False
            try:
                removed = await asyncio.to_thread(collect_volume_copies, root, budget, busy)
            except OSError as exc:
                log.warning("could not clean up volume copies in %s: %s", root, exc)
                return
            self.volume_collected_at = time.monotonic()
            for copy in removed:
                log.info(
                    "removed this node's copy of volume %s/%s (%.1f MB, unused by its "
                    "replicas here): volume copies were over --volume-cache-gb=%g",
                    copy.app,
                    copy.volume,
                    copy.disk_bytes / 1e6,
                    budget / 1e9,
                )
            if not self.volume_collection_again:
                return

    def _replica_env(self, command: dict[str, Any], gpus: Sequence[GpuDevice]) -> dict[str, str]:
        """The environment a replica of `command` runs with, less its runtime's pipes."""
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.update(secret_env(command))
        # One weights cache for every replica on this node (the reader's disk tier).
        env[WEIGHTS_CACHE_DIR_ENV] = str(self.config.work_dir / WEIGHTS_DIR)
        env[WEIGHTS_CACHE_BYTES_ENV] = str(self.config.weights_cache_bytes)
        env[VOLUMES_DIR_ENV] = self.config.volumes_dir  # also in its identity, for restores
        if self.config.gpus:  # a replica sees the GPUs it holds, and no other
            env[VISIBLE_DEVICES_ENV] = visible_devices(gpus)
        return env

    def _exec_context(
        self,
        bundle_dir: Path,
        command: dict[str, Any],
        gpus: Sequence[GpuDevice],
        cgroup_procs: Sequence[Path],
        python: str,
        pid: int,
    ) -> ExecContext:
        """How `ember replica exec` runs commands beside the replica: in its folder and
        cgroups, with its environment and its app's Python (and pip) first on PATH, and
        the replica's PID as this node sees it (for py-spy, gdb, /proc)."""
        env = self._replica_env(command, gpus)
        env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", os.defpath)])
        env[REPLICA_PID_ENV] = str(pid)
        return ExecContext(bundle_dir, env, tuple(cgroup_procs))

    def _take_gpus(
        self, record: RunningReplica, command: dict[str, Any], prefer: Sequence[str] = ()
    ) -> list[GpuDevice]:
        """The GPUs the replica asks for, from this node's free ones (NoFreeGpu if short);
        which ones goes into its log."""
        kind = command.get("gpu_type")
        count = int(command.get("gpu_count") or 0)
        held = bool(self.gpu_slots.held(record.replica_id))
        gpus = self.gpu_slots.take(record.replica_id, kind, count, prefer)
        if gpus and not held:
            names = ", ".join(f"{gpu.kind} #{gpu.index} ({gpu.visible_id})" for gpu in gpus)
            self._note(record, f"holds GPU {names}" if len(gpus) == 1 else f"holds GPUs {names}")
        return gpus

    def _limit_resources(self, record: RunningReplica) -> ReplicaCgroup | None:
        """The replica's own cgroups, capped at its endpoint's memory_limit= and
        cpu_limit=; None where it sets neither. A limit this node cannot enforce is said
        in its log, and the replica runs without it."""
        memory, cpu = record.memory_limit_mib, record.cpu_limit
        asked = [
            (MEMORY, memory, f"memory_limit={memory} (MiB)"),
            (CPU, cpu, f"cpu_limit={cpu:g}" if cpu is not None else ""),
        ]
        for controller, limit, setting in asked:
            problem = self.cgroups.problem(controller)
            if limit is not None and problem:
                self._note(
                    record, f"{setting} is not enforced on worker {self.config.name}: {problem}"
                )
        if self.cgroups.problem(MEMORY):
            memory = None
        if self.cgroups.problem(CPU):
            cpu = None
        if memory is None and cpu is None:
            return None
        try:
            record.cgroup = self.cgroups.create(record.replica_id, memory_mib=memory, cpu_limit=cpu)
        except OSError as exc:
            settings = " and ".join(s for _, limit, s in asked if limit is not None)
            self._note(record, f"{settings} could not be set, so it is not enforced: {exc}")
        return record.cgroup

    def _note_cpu_throttling(self, record: RunningReplica) -> None:
        """Tell the replica's log how much its cpu_limit= held it back, if at all."""
        cgroup = record.cgroup
        throttling = cgroup.cpu_throttling() if cgroup is not None else None
        if cgroup is None or throttling is None or cgroup.cpu_limit is None:
            return
        line = throttling.describe(cgroup.cpu_limit)
        if line is not None:
            self._note(record, line)

    def _note(self, replica: RunningReplica, text: str) -> None:
        """A line from the agent into the replica's own log."""
        log.info("replica %s: %s", replica.replica_id, text)
        self.log_buffer.append(
            {
                "ts": time.time(),
                "app": replica.app,
                "endpoint": replica.endpoint,
                "replica": replica.replica_id,
                "stream": "ember",
                "text": text,
            }
        )

    async def _report_exit(self, replica_id: str, returncode: int | None, detail: str) -> None:
        await self._send(
            {
                "type": "replica_exited",
                "replica_id": replica_id,
                "returncode": returncode,
                "detail": detail,
            }
        )

    async def _pipe_lines(self, replica: RunningReplica, fd: int, name: str) -> None:
        pipe = await open_reader(os.dup(fd))
        try:
            await self._read_lines(replica, pipe.reader, name)
        finally:
            pipe.close()

    async def _read_lines(
        self, replica: RunningReplica, stream: asyncio.StreamReader, name: str
    ) -> None:
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the stream limit: take what is there
                raw = await stream.read(65536)
            if not raw:
                return
            call, text = split_tag(raw.decode(errors="replace").rstrip("\n"))
            if name == "stderr":
                replica.stderr_tail.append((time.monotonic(), text))
            entry = {
                "ts": time.time(),
                "app": replica.app,
                "endpoint": replica.endpoint,
                "replica": replica.replica_id,
                "stream": name,
                "text": text,
            }
            if call is not None:
                entry["call"] = call
            self.log_buffer.append(entry)

    async def _stop_all(self, grace: float) -> None:
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
