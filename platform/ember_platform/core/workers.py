"""The workers: node agents joining (their hello), leaving or lost, and nodes drained
(`ember node drain`) and back in service; and whether any worker could ever run an
endpoint. Their heartbeats and reports are read by channel_messages.py.
"""

from __future__ import annotations

import secrets
import time

from ember.wire import messages as wire
from ember_platform.config import ServerConfig
from ember_platform.core.input_lifecycle import InputLifecycle
from ember_platform.core.replica_exec import ExecSessions
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.observability.logs import LogSink
from ember_platform.runtime.cluster_model import EndpointRuntime, ReplicaState, Worker
from ember_platform.runtime.live_state import LiveState
from ember_platform.scaling.scheduler import Demand, unservable_reason
from ember_platform.snapshots.events import SnapshotReports
from ember_platform.snapshots.registry import SnapshotRegistry
from ember_platform.storage.state_store import StateStore


class WorkerNameTaken(ValueError):
    """A worker's hello named a node that another live agent process is."""


class WorkerRoster:
    def __init__(
        self,
        state: LiveState,
        config: ServerConfig,
        store: StateStore,
        logs: LogSink,
        snapshots: SnapshotRegistry,
        reports: SnapshotReports,
        execs: ExecSessions,
        replicas: ReplicaLifecycle,
        inputs: InputLifecycle,
    ) -> None:
        self.state = state
        self.config = config
        self.store = store
        self.logs = logs
        self.snapshots = snapshots
        self.reports = reports
        self.execs = execs
        self.replicas = replicas
        self.inputs = inputs
        self.started_at = time.time()
        self.workers_version = 0  # bumped when a worker joins or leaves
        self.worker_left_at: float | None = None  # when a worker last left
        self._unservable: dict[str, tuple[tuple[int, Demand], str | None]] = {}

    def register(self, hello: wire.Hello) -> Worker:
        """A worker's hello. WorkerNameTaken when another live process has its name: node
        names pick nodes (`ember node drain`, listings), so two may not share one."""
        name = hello.name or "worker"
        instance = hello.instance
        for other in list(self.state.workers.values()):
            if other.name != name or not instance:
                continue
            if other.instance == instance:
                # The same agent, back before its old channel was seen to close.
                self.gone(other, "reconnected")
            else:
                raise WorkerNameTaken(
                    f"a worker named {name!r} is already joined (pid "
                    f"{other.pid or '?'}); start this one with another --name"
                )
        worker = Worker(
            id="w-" + secrets.token_hex(4),
            name=name,
            cpu=hello.cpu,
            memory=hello.memory,
            gpus=dict(hello.gpus),
            bundles=set(hello.bundles),
            snapshots=dict(hello.snapshots),
            memory_limits_problem=hello.memory_limits_problem,
            cpu_limits_problem=hello.cpu_limits_problem,
            labels=dict(hello.labels),
            loopback=hello.loopback,
            instance=instance,
            pid=hello.pid,
        )
        self.state.workers[worker.id] = worker
        self.workers_version += 1
        self.state.wake.set()
        self.reports.offer_all(worker)  # sent once it is welcomed, before any replica
        for held in hello.replicas:
            self._adopt_or_stop(worker, held)
        return worker

    def _adopt_or_stop(self, worker: Worker, held: wire.HeldReplica) -> None:
        """A replica the worker still runs from an earlier session. One this process has
        never known (another process started it, and this one took over; or this one
        restarted), of the version deployed now, is adopted: it serves on, no cold start
        or restore, however long the worker took to say hello. Any other (its app or
        version gone, the node draining, or one this process stopped or gave up as lost
        when the worker's channel closed) is stopped."""
        runtime = self.state.endpoints.get(held.label)
        if held.gang is not None:
            self.state.gang_member_held(held.gang, held.replica_id, worker.id)
        if (
            held.gang is None  # a gang is started anew: its members are not adopted one by one
            and runtime is not None
            and runtime.version == held.version
            and held.replica_id not in self.state.replicas
            and held.replica_id not in self.state.ended_replicas
            and not self.state.takes_no_replicas(worker)
        ):
            self.replicas.adopt(runtime, worker, held)
            return
        grace = self.config.stop_grace_seconds
        worker.send(wire.StopReplica(replica_id=held.replica_id, grace=grace))

    def gone(self, worker: Worker, reason: str) -> None:
        if self.state.workers.pop(worker.id, None) is None:
            return
        self.workers_version += 1
        self.snapshots.worker_gone(worker.id)
        self.execs.worker_gone(worker, reason)
        self.worker_left_at = time.time()
        self.state.gang_members_gone(worker.id)
        for replica in [r for r in self.state.replicas.values() if r.worker_id == worker.id]:
            # Not the replica's fault: it starts again elsewhere without a failure counted.
            self.inputs.replica_lost(
                replica, f"worker {worker.name} {reason}", startup_failure=False
            )
        worker.outbox.put_nowait("")

    def leaving(self, worker: Worker) -> None:
        """Stopped by its operator: what its replicas run finishes, nothing new goes there."""
        worker.leaving = True
        self._drain_replicas_on({worker.id}, f"worker {worker.name} is leaving")

    def drain_node(self, name: str) -> int:
        """`ember node drain`: the node's replicas finish what they run and stop, and no new
        ones are placed there until `uncordon_node`; the autoscaler starts replacements on
        other nodes. How many replicas drain."""
        ids = {w.id for w in self.state.workers.values() if w.name == name}
        self.store.put_draining_node(name, time.time())  # StoreWriteError: a 507, no drain
        self.state.draining_nodes.add(name)
        return self._drain_replicas_on(ids, f"node {name} is draining")

    def _drain_replicas_on(self, worker_ids: set[str], why: str) -> int:
        live = (ReplicaState.STARTING, ReplicaState.READY)
        draining = [
            r for r in self.state.replicas.values() if r.worker_id in worker_ids and r.state in live
        ]
        for replica in draining:
            self.logs.system(replica.endpoint.app, replica.endpoint.spec.name, why, replica.id)
            self.replicas.drain(replica)
        self.state.wake.set()  # replacements start elsewhere now, not on the next tick
        return len(draining)

    def uncordon_node(self, name: str) -> bool:
        """New replicas may go to the node again; False if it was not draining."""
        if name not in self.state.draining_nodes:
            return False
        self.store.delete_draining_node(name)
        self.state.draining_nodes.discard(name)
        self.state.wake.set()
        for worker in self.state.workers.values():
            if worker.name == name:
                self.reports.offer_all(worker)
        return True

    def reconnecting(self) -> bool:
        """Whether workers may still be reconnecting (after a start, or a worker leaving):
        what is registered is no verdict yet."""
        now = time.time()
        grace = self.config.reconnect_grace_seconds
        if now - self.started_at < grace:
            return True
        return self.worker_left_at is not None and now - self.worker_left_at < grace

    def unservable_reason(self, runtime: EndpointRuntime) -> str | None:
        """Why no worker could ever run this endpoint, or None.

        Right after a start, workers are still reconnecting: what is registered is not
        yet a verdict, so inputs queue for them instead. Likewise for a short while after
        a worker left: a restarting worker may be back soon, and it may be the one node
        that fits (its GPUs, its labels), whoever else is left.
        """
        if self.reconnecting():
            return None
        # Only the workers' totals matter, so the verdict holds until workers change.
        key = (self.workers_version, runtime.demand())
        cached = self._unservable.get(runtime.label)
        if cached is None or cached[0] != key:
            cached = (key, unservable_reason(runtime.demand(), self.state.capacities()))
            self._unservable[runtime.label] = cached
        return cached[1]
