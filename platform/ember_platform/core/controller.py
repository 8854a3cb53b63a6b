"""The control loop: autoscale every endpoint, place replicas, enforce leases."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from ember_platform.calls.schedules import lead_seconds
from ember_platform.core.cluster import Cluster
from ember_platform.core.scheduled_runs import run_due
from ember_platform.observability.engine_metrics import STALE_SECONDS
from ember_platform.observability.usage import USAGE_RETENTION_SECONDS
from ember_platform.runtime.cluster_model import EndpointRuntime, Replica, ReplicaState
from ember_platform.runtime.inputs import Outcome
from ember_platform.scaling.autoscaler import (
    Observation,
    ScalingSettings,
    desired_replicas,
    scale_down_key,
)
from ember_platform.scaling.scheduler import (
    Demand,
    Held,
    member_needs,
    place,
    place_gang,
    room_by_stopping,
)
from ember_platform.storage.state_store import StoreWriteError

log = logging.getLogger("ember.controller")

CALL_GC_INTERVAL = 300.0
COST_INTERVAL = 1.0  # seconds between additions to the replicas' cost in /metrics


class Controller:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._last_gc = 0.0
        self._costed_at = time.time()
        # Endpoints scaling on queue depth alone for want of their engine metric (said once).
        self._without_metric: set[tuple[str, str]] = set()
        self.schedule_lead = lead_seconds(os.environ)  # runs start this long before due

    async def run(self) -> None:
        tick = self.cluster.config.tick_seconds
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cluster.wake.wait(), tick)
            self.cluster.wake.clear()
            try:
                self.tick(time.time())
            except Exception:  # the loop must outlive any one bad tick
                log.exception("controller tick failed")

    def tick(self, now: float) -> None:
        self._check_leases(now)
        self.cluster.logs.flush()  # the requests' log lines since the last tick
        self.cluster.journal.tokens.flush(self.cluster.store)  # and their tokens
        if now - self._costed_at >= COST_INTERVAL:
            self._add_costs(now - self._costed_at)
            self._costed_at = now
        self.cluster.calls.retry()  # records a full disk kept in memory
        # Before scaling, so that a run's replica starts now.
        run_due(self.cluster, now + self.schedule_lead)
        for runtime in self.cluster.state.runtimes():
            self._scale(runtime, now)
        if now - self._last_gc > CALL_GC_INTERVAL:
            self._last_gc = now
            try:
                self.cluster.store.delete_calls_finished_before(
                    now - self.cluster.config.call_retention_seconds
                )
                self.cluster.store.delete_usage_before(now - USAGE_RETENTION_SECONDS)
                self.cluster.store.delete_expired_items(now)  # ember.Dict keys past their ttl
            except StoreWriteError as error:  # old records stay a while longer
                log.warning("expired call and usage records not deleted: %s", error)
            self.cluster.collect_garbage()
            self.cluster.collect_image_blobs()

    def _add_costs(self, seconds: float) -> None:
        """What the live replicas' time cost since the last time, at the operator's prices,
        into /metrics."""
        prices = self.cluster.config.prices
        if not prices.set:
            return
        for replica in self.cluster.replicas.values():
            runtime = replica.endpoint
            gpu_type, gpus = replica.gpu if replica.gpu is not None else (None, 0)
            rate = prices.per_second(runtime.settings.cpu, runtime.settings.memory, gpu_type, gpus)
            self.cluster.metrics.usage.replica_cost.labels(runtime.app, runtime.spec.name).inc(
                rate * seconds
            )

    def _scale(self, runtime: EndpointRuntime, now: float) -> None:
        cluster = self.cluster
        live = []
        previous = []  # replicas of an older deployment
        retiring = 0  # this version's, draining: still running inputs (max_inputs, a scale-down)
        for replica in list(runtime.replicas.values()):
            if replica.version != runtime.version:
                previous.append(replica)
            elif replica.state in (ReplicaState.STARTING, ReplicaState.READY):
                live.append(replica)
            elif replica.state is ReplicaState.DRAINING:
                retiring += 1
        serving = [r for r in previous if r.state is ReplicaState.READY]
        settings = runtime.settings
        target = settings.metric_target
        observation = Observation(
            queued=len(runtime.pending),
            # What older replicas still run for callers is work the new ones take over.
            running=sum(len(r.inflight) for r in (*live, *serving)),
            replica_idle_since=tuple(_idle_since(r) for r in live),
            now=now,
            metric_total=None
            if target is None
            else self._metric_total(runtime, [*live, *serving], target.name, now),
        )
        runtime.home_slots.update(
            observation.queued + observation.running,
            settings.scaling_concurrency,
            now,
            settings.scaledown_window,
        )
        desired = desired_replicas(
            observation,
            ScalingSettings(
                settings.min_replicas,
                settings.max_replicas,
                settings.scaling_concurrency,
                settings.scaledown_window,
                settings.buffer_replicas,
                None if target is None else target.per_replica,
            ),
        )
        # Draining replicas still run code: with them, no more than max_replicas at once
        # (max_replicas=1 is how a user asks for one input at a time on one GPU).
        room = settings.max_replicas - len(live) - retiring
        if desired > len(live) and room > 0:
            self._scale_up(runtime, min(desired - len(live), room), now)
        elif desired < len(live):
            window = settings.scaledown_window
            keys = {r.id: scale_down_key(_idle_since(r), r.placed_at, now, window) for r in live}
            for replica in sorted(live, key=lambda r: keys[r.id])[: len(live) - desired]:
                idle_since = _idle_since(replica)
                why = (
                    f"idle for {now - idle_since:.1f} s"
                    if keys[replica.id][0] == 0 and idle_since is not None
                    else f"more replicas than max_replicas={settings.max_replicas}, and it is "
                    "the most recently placed (it finishes its inputs first)"
                )
                cluster.logs.system(
                    runtime.app, runtime.spec.name, f"scaling down: {why}", replica.id
                )
                cluster.replica_lifecycle.drain(replica)
        self._retire_previous(runtime, previous, desired, now)

    def _metric_total(
        self, runtime: EndpointRuntime, replicas: list[Replica], name: str, now: float
    ) -> float | None:
        """The engine metric's sum over the ready replicas with a fresh value of it; None
        where none has one. Said once in the endpoint's logs when replicas that have been
        ready a while have none (no engine metrics, or not that one, or stale)."""
        ready = [r for r in replicas if r.state is ReplicaState.READY]
        values = [self.cluster.engine_metrics.value(r.id, name) for r in ready]
        fresh = [value for value in values if value is not None]
        key = (runtime.app, runtime.spec.name)
        if fresh:
            self._without_metric.discard(key)
            return sum(fresh)
        settled = any(now - (r.ready_at or now) > STALE_SECONDS for r in ready)
        if settled and key not in self._without_metric:
            self._without_metric.add(key)
            text = (
                f"scaling on queue depth alone: no replica has sent a fresh value of the "
                f"engine metric {name} (scale_on) for {STALE_SECONDS:g} s"
            )
            log.warning("%s: %s", runtime.label, text)
            self.cluster.logs.system(runtime.app, runtime.spec.name, text)
        return None

    def _retire_previous(
        self, runtime: EndpointRuntime, previous: list[Replica], desired: int, now: float
    ) -> None:
        """A redeploy without downtime: an older version's ready replicas serve on while
        the new version's are starting, one for each the new version still lacks, then
        drain. Replicas that have not started yet are stopped at once, and so are all
        of them when none of the new version's are starting (no work, or no room: on a
        full node they hold what the new ones need), unless the new version's fail to
        start and none is ready: a broken deploy leaves the old version serving, each of
        its replicas until it has been idle for the scale-down window (the new version
        has none whose idle time would hold the count up between calls), and the last
        one until a version that starts is deployed."""
        if not previous:
            return
        current = [r for r in runtime.replicas.values() if r.version == runtime.version]
        ready = sum(1 for r in current if r.state is ReplicaState.READY)
        starting = sum(1 for r in current if r.state is ReplicaState.STARTING)
        failing = runtime.startup_failures > 0 and not ready
        needed = max(0, desired - ready if failing else min(desired - ready, starting))
        if runtime.settings.rollout == "recreate":
            needed = 0
        serving = sorted(
            (r for r in previous if r.state is ReplicaState.READY),
            key=lambda r: len(r.inflight),
            reverse=True,  # the busiest stay: the idle ones cost nothing to stop
        )
        keep = set(serving[:needed])
        if failing and runtime.settings.rollout != "recreate":
            window = runtime.settings.scaledown_window
            keep.update(r for r in serving if r.inflight or now - (r.idle_since or now) < window)
            if serving and not keep:
                # The last one stays however long it idles, as a stuck rollout keeps old
                # pods: an old replica that went could not come back (only the new
                # version starts), and the endpoint would be down until a deploy mends it.
                keep.add(max(serving, key=lambda r: r.idle_since or now))
        for replica in previous:
            if replica not in keep:
                self.cluster.replica_lifecycle.drain(replica)

    def _scale_up(self, runtime: EndpointRuntime, count: int, now: float) -> None:
        cluster = self.cluster
        if now < runtime.backoff_until:
            return
        reason = cluster.roster.unservable_reason(runtime)
        if reason is not None:
            outcome = Outcome.error(503, "no_capacity", f"{runtime.label}: {reason}")
            cluster.input_lifecycle.fail_queued(runtime, outcome)
            return
        demand = cluster.replica_lifecycle.demand_of(runtime)
        if demand.nodes > 1:
            self._scale_up_gangs(runtime, demand, count)
            return
        for _ in range(count):
            placement = place(demand, cluster.state.capacities())
            if placement is None:
                # Every node is full now: queued inputs wait for capacity, which idle
                # replicas of other endpoints give back sooner than their scale-down would.
                if runtime.pending:
                    self._make_room(runtime)
                return
            cluster.replica_lifecycle.start(
                runtime, cluster.workers[placement.worker_id], placement.gpu
            )

    def _scale_up_gangs(self, runtime: EndpointRuntime, demand: Demand, count: int) -> None:
        """Gangs placed whole or not at all: one that does not fit now holds nothing and
        waits, saying why (idle replicas of others are not stopped for it)."""
        cluster = self.cluster
        for _ in range(count):
            capacities = cluster.state.capacities()
            placements = place_gang(demand, capacities)
            if placements is None:
                fit = sum(1 for node in capacities if node.fits(demand))
                runtime.placement_wait = (
                    f"waiting for {demand.nodes} nodes with room for a gang member "
                    f"({member_needs(demand)}); {fit} have room now"
                )
                return
            workers = [cluster.workers[p.worker_id] for p in placements]
            if cluster.gangs.start(runtime, workers, placements[0].gpu) is None:
                return  # no ports for it: it says why
            runtime.placement_wait = None

    def _make_room(self, runtime: EndpointRuntime) -> None:
        """Stop idle replicas of other endpoints (beyond their min_replicas, and only of
        endpoints with nothing queued) where that lets `runtime` start one."""
        cluster = self.cluster
        evictable: list[Held] = []
        for other in cluster.state.runtimes():
            busy = any(r.inflight for r in other.replicas.values())
            if other is runtime or other.pending or (busy and other.settings.buffer_replicas):
                continue  # it needs its idle replicas (buffer ones are idle by design)
            live = [
                r
                for r in other.replicas.values()
                if r.state in (ReplicaState.STARTING, ReplicaState.READY)
            ]
            idle = sorted(
                (r for r in live if r.state is ReplicaState.READY and not r.inflight),
                key=lambda r: r.idle_since or 0.0,
            )
            spare = max(0, len(live) - other.settings.min_replicas)
            evictable.extend(_held(r, r.idle_since or 0.0) for r in idle[:spare])
        evictable.extend(
            _held(r, None) for r in cluster.replicas.values() if r.state is ReplicaState.STOPPING
        )
        chosen = room_by_stopping(runtime.demand(), cluster.state.capacities(), evictable)
        for replica_id in chosen or ():
            replica = cluster.replicas[replica_id]
            cluster.logs.system(
                replica.endpoint.app,
                replica.endpoint.spec.name,
                f"stopping an idle replica: its node has no room for {runtime.label}'s queued work",
                replica.id,
            )
            cluster.replica_lifecycle.drain(replica)

    def _check_leases(self, now: float) -> None:
        cluster = self.cluster
        config = cluster.config
        for worker in list(cluster.workers.values()):
            if now - worker.last_seen > config.worker_lease_seconds:
                cluster.roster.gone(worker, "stopped sending heartbeats")
        for replica in list(cluster.replicas.values()):
            if replica.state is ReplicaState.STARTING:
                limit = replica.endpoint.settings.startup_timeout or config.startup_timeout
                if now - replica.created_at > limit:
                    cluster.input_lifecycle.replica_lost(
                        replica, f"not ready after {limit:g} s (startup_timeout)"
                    )
            elif replica.outbox is not None and now - replica.last_seen > config.lease_seconds:
                # Heartbeats come from the replica's event loop: async code that blocks
                # it (time.sleep, CPU work in an async def) stops them, as a hang does.
                cluster.input_lifecycle.replica_lost(
                    replica,
                    f"no heartbeat for {config.lease_seconds:g} s: its process hung, or "
                    "async code blocked its event loop (blocking work in an async def "
                    "belongs in a def method, or in asyncio.to_thread)",
                )
            elif (
                replica.state is ReplicaState.STOPPING
                and now - replica.last_seen > config.stop_grace_seconds + config.lease_seconds
            ):
                cluster.input_lifecycle.replica_lost(replica, "did not stop in time")


def _idle_since(replica: Replica) -> float | None:
    """When a ready replica with nothing to run last became idle; None while it runs
    inputs or starts."""
    return (
        replica.idle_since if replica.state is ReplicaState.READY and not replica.inflight else None
    )


def _held(replica: Replica, idle_since: float | None) -> Held:
    settings = replica.endpoint.settings
    return Held(
        replica.id, replica.worker_id, settings.cpu, settings.memory, replica.gpu, idle_since
    )
