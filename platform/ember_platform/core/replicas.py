"""Replicas from start to end: started on a worker (restored from a snapshot when one
fits), ready, drained, stopped, or removed when lost; what each held is recorded as usage.

What happens to the inputs a lost replica ran is the input lifecycle's to decide
(`InputLifecycle.replica_lost`); this part only takes the replica out of the picture.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

from ember.wire import messages as wire
from ember.wire.gangs import GangMember
from ember.wire.labels import split_app_key
from ember_platform.config import ServerConfig
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.cluster_model import (
    EndpointRuntime,
    Replica,
    ReplicaState,
    Worker,
)
from ember_platform.runtime.inputs import Input
from ember_platform.runtime.live_state import LiveState
from ember_platform.scaling.scheduler import Demand, GpuChoice, weights_bytes_held
from ember_platform.security.secrets import SecretRegistry, env_digest
from ember_platform.snapshots.registry import SnapshotRegistry
from ember_platform.storage.records import ReplicaUsage
from ember_platform.storage.state_store import StateStore, StoreWriteError

STARTUP_FAILURES_BEFORE_GIVING_UP = 3
log = logging.getLogger("ember.cluster")


class ReplicaLifecycle:
    def __init__(
        self,
        state: LiveState,
        config: ServerConfig,
        store: StateStore,
        logs: LogSink,
        metrics: PlatformMetrics,
        snapshots: SnapshotRegistry,
        secrets: SecretRegistry,
    ) -> None:
        self.state = state
        self.config = config
        self.store = store
        self.logs = logs
        self.metrics = metrics
        self.snapshots = snapshots
        self.secrets = secrets

    def replica_env(self, runtime: EndpointRuntime) -> dict[str, str]:
        """The endpoint's own variables, then its secrets' (which win)."""
        return self.secrets.replica_env(split_app_key(runtime.app)[0], runtime.settings)

    def demand_of(self, runtime: EndpointRuntime) -> Demand:
        """What a new replica of `runtime` needs, and the nodes that hold the snapshot
        image it would restore from or some of its weights (the scheduler prefers them)."""
        workers = self.state.workers.values()
        images = self.snapshots.images_at(
            runtime,
            workers,
            env_digest(self.replica_env(runtime)),
            runtime.settings.gpu_choices or (None,),
        )
        urls = runtime.settings.weights.values()
        weights = frozenset(
            (worker.id, held)
            for worker in workers
            if (held := weights_bytes_held(urls, worker.cached_weights))
        )
        return dataclasses.replace(runtime.demand(), images_at=images, weights_at=weights)

    def start(
        self, runtime: EndpointRuntime, worker: Worker, gpu: GpuChoice | None = None
    ) -> Replica:
        """Start a replica on `worker`, holding `gpu` (type, count): the endpoint's GPU
        choice the scheduler placed it with (by default its first)."""
        if gpu is None and runtime.settings.gpu_choices:
            gpu = runtime.settings.gpu_choices[0]
        replica = self.new(runtime, worker, gpu)
        runtime.replicas[replica.id] = replica
        env = self.replica_env(runtime)
        snapshot, note = self.snapshots.plan(runtime, worker, replica.id, env_digest(env), gpu)
        if snapshot is not None and snapshot.action == "restore":
            replica.restoring_from = (snapshot.key, snapshot.image_id)
        self.send_start(runtime, worker, replica, env, snapshot, note)
        return replica

    def new(self, runtime: EndpointRuntime, worker: Worker, gpu: GpuChoice | None) -> Replica:
        """A replica of `runtime` placed on `worker`, in the picture (not yet the
        endpoint's: a gang's members but its first never are)."""
        replica = Replica(
            id="r-" + secrets.token_hex(6),
            endpoint=runtime,
            version=runtime.version,
            worker_id=worker.id,
            token=secrets.token_urlsafe(24),
            gpu=gpu,
            methods=dict(runtime.spec.methods),
            concurrency=runtime.settings.concurrency,
        )
        self.state.replicas[replica.id] = replica
        return replica

    def send_start(
        self,
        runtime: EndpointRuntime,
        worker: Worker,
        replica: Replica,
        env: dict[str, str],
        snapshot: wire.SnapshotPlan | None,
        note: str | None,
        gang: GangMember | None = None,
    ) -> None:
        """The worker told to start `replica` (`note`: why it takes no snapshot, said
        once in the endpoint's log)."""
        if note and note != runtime.snapshot_note:
            runtime.snapshot_note = note
            self.logs.system(runtime.app, runtime.spec.name, note)
        else:
            note = None  # said once already
        gpu = replica.gpu
        worker.send(
            wire.StartReplica(
                replica_id=replica.id,
                token=replica.token,
                call_token=replica.call_token,
                app=runtime.app,
                endpoint=runtime.spec.name,
                label=runtime.label,
                version=runtime.version,
                bundle_digest=runtime.bundle_digest,
                entry=runtime.entry,
                attribute=runtime.spec.attribute,
                concurrency=runtime.settings.concurrency,
                memory=runtime.settings.memory,
                memory_limit=runtime.settings.memory_limit,
                cpu_limit=runtime.settings.cpu_limit,
                cpu=runtime.settings.cpu,
                log_rate=runtime.settings.log_rate,
                requirements=runtime.settings.requirements,
                env=env,
                gpu_type=gpu[0] if gpu else None,
                gpu_count=gpu[1] if gpu else 0,
                snapshot=snapshot,
                snapshot_note=note,
                image=runtime.settings.image,
                gang=gang,
            )
        )
        worker.bundles.add(runtime.bundle_digest)
        where = f"worker {worker.name}"
        if gang is not None:
            where += f", rank {gang.rank} of gang {gang.gang_id}"
        self.logs.system(runtime.app, runtime.spec.name, f"starting replica on {where}", replica.id)

    def adopt(self, runtime: EndpointRuntime, worker: Worker, held: wire.HeldReplica) -> Replica:
        """A replica that another control-plane process started (or this one, before a
        restart), named by its worker's hello: recorded as starting, with the token it
        opens its channel with, and ready when that channel opens again."""
        gpu = (held.gpu_type, held.gpu_count) if held.gpu_type else None
        replica = Replica(
            id=held.replica_id,
            endpoint=runtime,
            version=held.version,
            worker_id=worker.id,
            token=held.token,
            gpu=gpu,
            methods=dict(runtime.spec.methods),
            concurrency=runtime.settings.concurrency,
        )
        if held.call_token:
            replica.call_token = held.call_token  # its code holds this one
        replica.placed_at = replica.created_at - max(0.0, held.running_seconds)
        replica.start = {"kind": wire.ADOPTED}
        self.state.replicas[replica.id] = replica
        runtime.replicas[replica.id] = replica
        self.logs.system(
            runtime.app, runtime.spec.name, f"adopting replica on worker {worker.name}", replica.id
        )
        return replica

    def ready(self, replica: Replica, start: wire.StartReport) -> Replica | None:
        """The replica says it is ready, with how its start went: the replica that now
        takes inputs (it, or its gang's first once every member is ready), or None."""
        if replica.state is not ReplicaState.STARTING:
            return None
        gang = replica.gang
        if gang is not None and replica is gang.lead and not gang.all_ready():
            gang.lead_ready = start  # it takes inputs once its peers are ready too
            return None
        self._started(replica, start)
        if gang is None or replica is gang.lead:
            return replica
        # A member (it takes no inputs of its own): the last one ready makes rank 0 serve.
        lead_start = gang.lead_ready
        if lead_start is None or not gang.all_ready():
            return None
        gang.lead_ready = None
        return self.ready(gang.lead, lead_start)

    def _started(self, replica: Replica, start: wire.StartReport) -> None:
        """Ready: how it started recorded, counted and said."""
        now = time.time()
        replica.state = ReplicaState.READY
        replica.ready_at = now
        replica.idle_since = now
        if start.kind == wire.ADOPTED:
            # Its channel is open again: it started long ago, and its start was counted.
            replica.start = {"kind": wire.ADOPTED, **replica.start}
            self.logs.system(
                replica.endpoint.app,
                replica.endpoint.spec.name,
                f"adopted replica ready after {now - replica.created_at:.3f} s",
                replica.id,
            )
            return
        runtime = replica.endpoint
        runtime.startup_failures = 0
        runtime.last_startup_error = ""
        phases = {f"{name}_seconds": round(value, 4) for name, value in start.phases().items()}
        replica.start = {
            "kind": start.kind,
            "total_seconds": round(now - replica.created_at, 4),
            **phases,
            **replica.start,  # a lazy restore's memory may be all in before `ready`
        }
        runtime.last_start = replica.start
        if start.image_root:  # an image= replica's root: "lazy", "extracted (why)"
            replica.start["image_root"] = start.image_root
        if start.memory_pending:
            replica.start["lazy"] = True
            if "memory_in_seconds" not in replica.start:
                # It runs while its memory arrives. Should CRIU's page daemon fail, the
                # kernel hands it zeroed pages until the agent kills it, so nothing it
                # sends about an input counts until its memory is in; if it never is, the
                # replica is lost and its inputs are retried as for any lost replica.
                replica.held = []
        self._keep_start(replica)
        self.metrics.replica_started(runtime.app, runtime.spec.name, replica.start)
        if replica.start["kind"] == "restore" and replica.restoring_from is not None:
            key, image_id = replica.restoring_from
            self.snapshots.restored(key, image_id, replica.start["total_seconds"])
        described = ", ".join(f"{k.removesuffix('_seconds')} {v:.3f} s" for k, v in phases.items())
        self.logs.system(
            runtime.app,
            runtime.spec.name,
            f"replica ready after {now - replica.created_at:.3f} s "
            f"({replica.start['kind']}: {described})",
            replica.id,
        )

    def unhealthy(self, replica: Replica, reason: str) -> None:
        """Its health check failed: it takes no new inputs, finishes those it runs, and
        stops; the autoscaler no longer counts it, so a replacement starts if needed."""
        if replica.state is not ReplicaState.READY:
            return
        runtime = replica.endpoint
        self.metrics.replica_unhealthy(runtime.app, runtime.spec.name)
        runtime.last_unhealthy = {"replica": replica.id, "reason": reason, "at": time.time()}
        running = (
            f", after the {len(replica.inflight)} input(s) it runs" if replica.inflight else ""
        )
        self.logs.system(
            runtime.app,
            runtime.spec.name,
            f"replica is unhealthy ({reason}); replacing it{running}",
            replica.id,
        )
        self.drain(replica)
        self.state.wake.set()  # the autoscaler starts its replacement now, not on the next tick

    def retire_after_inputs(self, replica: Replica, limit: int) -> None:
        """It was handed its `max_inputs`: it takes no more, stops once they are done,
        and the autoscaler no longer counts it, so a fresh replica takes the next ones."""
        if replica.state is not ReplicaState.READY:
            return
        runtime = replica.endpoint
        self.logs.system(
            runtime.app,
            runtime.spec.name,
            f"replica took its max_inputs={limit}; it stops once they are done",
            replica.id,
        )
        self.drain(replica)
        self.state.wake.set()  # a replacement for what waits starts now, not on the next tick

    def startup_failed(self, runtime: EndpointRuntime, message: str) -> bool:
        """A replica of `runtime` failed to start: the next waits out a backoff. True
        once so many failed in a row that its queued inputs should fail too."""
        runtime.startup_failures += 1
        runtime.last_startup_error = message
        runtime.backoff_until = time.time() + min(30.0, 0.5 * 2**runtime.startup_failures)
        self.logs.system(runtime.app, runtime.spec.name, f"replica failed to start: {message}")
        return runtime.startup_failures >= STARTUP_FAILURES_BEFORE_GIVING_UP

    def drain(self, replica: Replica) -> None:
        """Take no new inputs; stop once the inputs in flight are done (a gang: its
        first member drains, and every member stops with it)."""
        if replica.gang is not None:
            replica = replica.gang.lead
        if replica.state is ReplicaState.STARTING:
            # Nothing runs on it yet: it goes at once.
            self.remove(replica, "no longer needed while starting")
        elif replica.state is ReplicaState.READY:
            replica.state = ReplicaState.DRAINING
            if not replica.inflight:
                self.stop(replica)

    def stop(self, replica: Replica) -> None:
        """Its exit hooks run, then it ends (a gang: every member)."""
        for member in replica.gang.members if replica.gang is not None else [replica]:
            if member.id not in self.state.replicas or member.state is ReplicaState.STOPPING:
                continue
            member.state = ReplicaState.STOPPING
            worker = self.state.workers.get(member.worker_id)
            if worker is not None:
                worker.send(
                    wire.StopReplica(replica_id=member.id, grace=self.config.stop_grace_seconds)
                )
            runtime = member.endpoint
            self.logs.system(runtime.app, runtime.spec.name, "replica stopping", member.id)

    def remove(self, replica: Replica, reason: str) -> list[Input]:
        """The replica is gone or must go: out of the picture, killed on its worker.
        Returns the inputs it was running, for the caller to requeue or fail."""
        if replica.id not in self.state.replicas:
            return []  # gone already
        runtime = replica.endpoint
        self.forget(replica)
        worker = self.state.workers.get(replica.worker_id)
        if worker is not None:
            worker.send(wire.KillReplica(replica_id=replica.id))
        self.logs.system(runtime.app, runtime.spec.name, f"replica lost: {reason}", replica.id)
        inflight = list(replica.inflight.values())
        replica.inflight.clear()
        self.state.wake.set()
        if replica.gang is not None:  # one member's end is its gang's: the rest are killed
            why = f"rank {replica.rank} of its gang {replica.gang.id} was lost ({reason})"
            for member in replica.gang.members:
                inflight += self.remove(member, why)
        return inflight

    def forget(self, replica: Replica) -> None:
        """Out of the picture, its usage recorded, its channel closed."""
        if replica.id in self.state.replicas:  # once, however many paths lead here
            try:
                self.store.put_usage(self.usage_of(replica, time.time()))
            except StoreWriteError as error:  # an account, not state: it may lose one
                log.warning("usage of replica %s not recorded: %s", replica.id, error)
        if replica.disconnect_timer is not None:
            replica.disconnect_timer.cancel()
            replica.disconnect_timer = None
        self.snapshots.replica_gone(replica.id)
        self.state.take_early(replica)  # what it said before its memory was in: never read
        if self.state.replicas.pop(replica.id, None) is not None:
            self.state.replica_ended(replica.id, time.time())
        replica.endpoint.replicas.pop(replica.id, None)
        replica.endpoint.prefixes.forget(replica.id)
        self.metrics.forget_replica(replica.id)
        if replica.outbox is not None:
            replica.outbox.put_nowait("")  # tells the writer to close the channel

    def start_phase(self, replica: Replica, phase: str, seconds: float) -> None:
        """A phase known after `ready` (its first input, a lazy restore's memory), which
        the caller has put in `replica.start`."""
        runtime = replica.endpoint
        kind = str(replica.start.get("kind", "cold"))
        self.metrics.start_phase(runtime.app, runtime.spec.name, kind, phase, seconds)
        if runtime.last_start is replica.start:
            self._keep_start(replica)

    def _keep_start(self, replica: Replica) -> None:
        """The endpoint's last start, kept for `ember ls` and the dashboard across a
        restart of the control plane."""
        runtime = replica.endpoint
        try:
            self.store.put_endpoint_start(runtime.label, runtime.app, replica.start, time.time())
        except StoreWriteError as error:  # what it shows, not state: it may lose one
            log.warning("last start of %s not recorded: %s", runtime.label, error)

    def usage_of(self, replica: Replica, until: float) -> ReplicaUsage:
        """What the replica has held from its placement until `until`."""
        runtime = replica.endpoint
        gpu_type, gpu_count = replica.gpu if replica.gpu is not None else (None, 0)
        # An adopted replica's time here is a record of its own: the process that started
        # it may have recorded its time up to its orderly stop under its id.
        usage_id = replica.id
        if replica.start.get("kind") == wire.ADOPTED:
            usage_id = f"{replica.id}@{replica.created_at:.3f}"
        return ReplicaUsage(
            replica_id=usage_id,
            app=runtime.app,
            endpoint=runtime.spec.name,
            gpu_type=gpu_type,
            gpu_count=gpu_count,
            cpu=runtime.settings.cpu,
            memory_mib=runtime.settings.memory,
            start_kind=replica.start.get("kind") if replica.ready_at is not None else None,
            inputs=replica.served,
            started_at=replica.created_at,
            ended_at=until,
        )

    def record_live_usage(self) -> int:
        """At a stop: the usage of the replicas alive now, up to now. They end with it
        (a worker stops its replicas when its channel closes), and their records would
        otherwise be lost. How many were recorded."""
        now = time.time()
        recorded = 0
        for replica in list(self.state.replicas.values()):
            try:
                self.store.put_usage(self.usage_of(replica, now))
            except StoreWriteError as error:
                log.warning("usage of replica %s not recorded: %s", replica.id, error)
                continue
            recorded += 1
        self.state.replicas.clear()  # recorded once: nothing may write them again
        return recorded
