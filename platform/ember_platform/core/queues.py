"""The endpoints' queues, and the handing of inputs to replicas.

An input waits in its endpoint's queue (by priority, then arrival; a retried one at the
front), a synchronous one at most the endpoint's `queue_timeout`, until a ready replica
has room. It is then sent to that replica, with a timer for the endpoint's `timeout`.
What happens when either time is up is the input lifecycle's to say: it hands its
`finish` and `run_timed_out` in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from ember.wire import messages as wire
from ember_platform.calls.journal import CallJournal
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.observability.engine_metrics import EngineMetrics
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.affinity import home_replica
from ember_platform.runtime.cluster_model import EndpointRuntime, Replica, ReplicaState
from ember_platform.runtime.inputs import Input, InputPhase, Outcome
from ember_platform.runtime.live_state import LiveState
from ember_platform.scaling.prefix_routing import ENGINE_WAITING, routing_load
from ember_platform.storage.records import CallStatus


def takes_alongside(replica: Replica, inp: Input) -> bool:
    """Whether the replica may take the input beside what it runs: an input suspected of
    crashing a replica runs alone, on a replica with nothing else in flight."""
    if inp.suspect and replica.inflight:
        return False
    if replica.gang is not None and replica.gang.behind():
        return False
    return not any(running.suspect for running in replica.inflight.values())


def previous_version_replica(runtime: EndpointRuntime, inp: Input) -> Replica | None:
    """While a redeploy's replicas start, a ready one of an older version that the
    controller keeps serving takes the input, if its method is the same there."""
    method = runtime.spec.methods.get(inp.method)
    if runtime.settings.rollout == "recreate":
        return None  # calls wait for the new version
    serving = [
        replica
        for replica in runtime.replicas.values()
        if replica.version != runtime.version
        and replica.state is ReplicaState.READY
        and replica.outbox is not None
        and method is not None
        and replica.methods.get(inp.method) == method
        and takes_alongside(replica, inp)
    ]
    best: Replica | None = None
    for replica in serving:  # the least busy with room
        load = len(replica.inflight)
        if load < replica.concurrency and (best is None or load < len(best.inflight)):
            best = replica
    return best


def pick_replica(ready: list[Replica], target: int, concurrency: int) -> Replica | None:
    """The replica to give the next input, of those ready for it, or None when all are
    full. Below the target, the busiest: inputs pack onto busy replicas so that spare
    ones go idle and scale down. Past it (the autoscaler's new replicas not ready yet),
    the least busy with room, so the overflow spreads rather than piles onto one."""
    best: Replica | None = None
    for replica in ready:
        load = len(replica.inflight)
        if load < target and (best is None or load > len(best.inflight)):
            best = replica
    if best is not None:
        return best
    for replica in ready:
        load = len(replica.inflight)
        if load < concurrency and (best is None or load < len(best.inflight)):
            best = replica
    return best


class Queues:
    def __init__(
        self,
        state: LiveState,
        replicas: ReplicaLifecycle,
        journal: CallJournal,
        metrics: PlatformMetrics,
        *,
        finish: Callable[[Input, Outcome], None],  # ends an input that waited too long
        run_timed_out: Callable[[Input, float], None],  # an input ran past its timeout
        engine_metrics: EngineMetrics | None = None,  # engines' queues, for prefix routing
    ) -> None:
        self.state = state
        self.replicas = replicas
        self.journal = journal
        self.metrics = metrics
        self.engine_metrics = engine_metrics
        self._finish = finish
        self._run_timed_out = run_timed_out

    def enqueue(self, runtime: EndpointRuntime, inp: Input, *, front: bool = False) -> None:
        """Queue it (a retried input at the front), its wait bounded by the endpoint's
        `queue_timeout`; a spawned call waits as long as it takes."""
        pending = runtime.pending
        if front:
            pending.appendleft(inp)
        elif not pending or pending[-1].priority <= inp.priority:
            pending.append(inp)  # the usual case: one priority, arrival order
        else:
            # Behind every input of its priority or a higher one, ahead of lower ones.
            place = len(pending)
            while place and pending[place - 1].priority > inp.priority:
                place -= 1
            pending.insert(place, inp)
        limit = runtime.settings.queue_timeout
        if limit is not None and not inp.is_async:
            inp.arm(InputPhase.QUEUED, limit, self._queue_expired, runtime, inp, limit)

    def _queue_expired(self, runtime: EndpointRuntime, inp: Input, limit: float) -> None:
        if inp.done or inp not in runtime.pending:
            return
        runtime.pending.remove(inp)
        self._finish(
            inp,
            Outcome.error(
                504,
                "queue_timeout",
                f"{inp.label} had no replica free to take it within queue_timeout={limit:g} s "
                f"(its max_replicas={runtime.settings.max_replicas} were busy or starting); "
                "retry later",
            ),
        )

    def dispatch(self, runtime: EndpointRuntime) -> None:
        """Hand the runtime's queued inputs, in order, to replicas with room."""
        settings = runtime.settings
        while runtime.pending:
            inp = runtime.pending[0]
            ready = [
                replica
                for replica in runtime.replicas.values()
                if replica.state is ReplicaState.READY
                and replica.outbox is not None  # its channel closed: lost in a moment
                and replica.version == runtime.version
                and takes_alongside(replica, inp)
            ]
            home = None
            if inp.affinity is not None:
                home = home_replica(inp.affinity, ready, runtime.home_slots.count)
            if home is not None and len(home.inflight) < settings.concurrency:
                best: Replica | None = home
            elif inp.prefix is not None:  # set only for calls without a key
                best = self._by_prefix(runtime, inp.prefix, ready)
            else:  # no key, or its home is full: the usual choice among the rest
                best = pick_replica(ready, settings.scaling_concurrency, settings.concurrency)
            if best is None:
                best = previous_version_replica(runtime, inp)
            if best is None:
                return
            runtime.pending.popleft()
            if inp.done:
                continue
            if home is not None:
                self.metrics.affinity_routed(runtime.app, runtime.spec.name, best is home)
            self._assign(inp, best)

    def _engine_waiting(self, replica_id: str) -> float | None:
        """Requests waiting in the replica's engine's own queue, by its latest fresh
        scrape; None when it exports no such gauge."""
        if self.engine_metrics is None:
            return None
        for name in ENGINE_WAITING:
            waiting = self.engine_metrics.value(replica_id, name)
            if waiting is not None:
                return waiting
        return None

    def _by_prefix(
        self, runtime: EndpointRuntime, prefix: tuple[bytes, ...], ready: list[Replica]
    ) -> Replica | None:
        """The ready replica with room whose engine most likely caches the longest prefix
        of the prompt (scaling/prefix_routing.py), counted by how it was chosen."""
        settings = runtime.settings
        with_room = {r.id: r for r in ready if len(r.inflight) < settings.concurrency}
        if not with_room:
            return None  # it waits in the queue, not yet placed
        busy_at = settings.scaling_concurrency
        loads = {
            replica_id: routing_load(len(r.inflight), self._engine_waiting(replica_id), busy_at)
            for replica_id, r in with_room.items()
        }
        chosen, placement = runtime.prefixes.choose(prefix, loads, busy_at)
        self.metrics.prefix_routed_to(runtime.app, runtime.spec.name, placement)
        if chosen is None:  # no replica holds it: placed as any call is
            return pick_replica(ready, settings.scaling_concurrency, settings.concurrency)
        return with_room[chosen]

    def _assign(self, inp: Input, replica: Replica) -> None:
        inp.replica_id = replica.id
        # Pieces of an attempt on a replica lost before it sent the rest.
        inp.result_parts, inp.result_pieces = bytearray(), 0
        inp.attempts += 1
        inp.dispatched_at = time.time()
        replica.inflight[inp.id] = inp
        if inp.prefix is not None:  # its engine caches this prompt's blocks from now on
            replica.endpoint.prefixes.served(replica.id, inp.prefix)
        replica.idle_since = None
        replica.assigned += 1
        limit = replica.endpoint.settings.max_inputs
        if limit is not None and replica.assigned >= limit:
            self.replicas.retire_after_inputs(replica, limit)
        timeout = replica.endpoint.settings.timeout
        inp.arm(InputPhase.RUNNING, timeout, self._run_timed_out, inp, timeout)
        header = wire.Input(
            id=inp.id,
            method=inp.method,
            stream=inp.streaming,
            affinity=inp.affinity,
            trace=inp.trace.traceparent if inp.trace is not None else None,
            priority=inp.priority,
        )
        replica.send(header, inp.body)
        if replica.gang is not None and replica.gang.every_rank:  # a copy to each member
            echo = msgspec.structs.replace(header, echo=True)
            for member in replica.gang.echoed():
                replica.gang.copies.setdefault(member.id, set()).add(inp.id)
                member.send(echo, inp.body)
        if inp.inbox:  # a WebSocket's messages that came while it queued
            for message in inp.inbox:
                replica.send(wire.InputMessage(id=inp.id), message)
            inp.inbox = None
        if inp.is_async:
            self.journal.persist(inp, CallStatus.RUNNING)
