"""The control plane's live picture: endpoints with their queues, workers and replicas.

Everything here runs on the event loop's thread; methods are synchronous so that state
changes are atomic between awaits. Messages to workers and replicas go through outboxes
that a writer task per connection drains.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
from typing import Any

from ember.endpoints.retries import retry_delay
from ember.errors import InvalidError
from ember.files import received_file_header
from ember.wire.labels import make_label
from ember.wire.limits import MAX_FILE_RESULT_BYTES, MAX_RESULT_BYTES, MIB, STREAM_ACK_BYTES
from ember.wire.spec import AppManifest
from ember_platform.calls.records import CallRecords
from ember_platform.calls.stats import RequestStats
from ember_platform.calls.webhooks import WebhookSender
from ember_platform.config import ServerConfig
from ember_platform.core.affinity import home_replica
from ember_platform.core.canaries import withdraw_canary
from ember_platform.core.cluster_model import EndpointRuntime, Replica, ReplicaState, Worker, frame
from ember_platform.core.inputs import CHUNK, END, EVENT, Input, Outcome
from ember_platform.core.replica_exec import ExecSessions
from ember_platform.core.scaling_overrides import SCALABLE, effective_settings, merged
from ember_platform.core.scheduler import (
    Demand,
    GpuChoice,
    NodeCapacity,
    unservable_reason,
    weights_bytes_held,
)
from ember_platform.errors import DiskFull, QueueFull, UnknownEndpoint
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.spans import SpanExporter
from ember_platform.security.secrets import SecretRegistry, env_digest
from ember_platform.snapshots.events import (
    QUIET_SNAPSHOT_REPORTS,
    SNAPSHOT_EVENTS,
    image_dropped,
    offer_snapshots,
    snapshot_event,
)
from ember_platform.snapshots.lifecycle import SnapshotRegistry
from ember_platform.storage.blobs import BlobStore, LocalBlobStore
from ember_platform.storage.records import (
    WEBHOOK_PENDING,
    CallRecord,
    CallStatus,
    Deployment,
    ReplicaUsage,
    ScalingOverride,
)
from ember_platform.storage.state_store import StateStore, StoreWriteError

STARTUP_FAILURES_BEFORE_GIVING_UP = 3
log = logging.getLogger("ember.cluster")


# Why a call made by an input's code is cancelled when that run of the input ends but the
# input is retried: its new run makes its own calls.
RUN_ENDED = "the run of {} that made it has ended; it runs again"


class WorkerNameTaken(ValueError):
    """A worker's hello named a node that another live agent process is."""


# Errors of inputs whose code raised that a retry would not mend.
NOT_RETRIED_ERRORS = frozenset({"result_too_large"})


def takes_alongside(replica: Replica, inp: Input) -> bool:
    """Whether the replica may take the input beside what it runs: an input suspected of
    crashing a replica runs alone, on a replica with nothing else in flight."""
    if inp.suspect and replica.inflight:
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


class Cluster:
    def __init__(
        self,
        config: ServerConfig,
        store: StateStore,
        logs: LogSink,
        snapshots: SnapshotRegistry | None = None,
        blobs: BlobStore | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.calls = CallRecords(store)
        self.secrets = SecretRegistry(store)
        self.logs = logs
        self.execs = ExecSessions()  # `ember replica exec` commands in flight
        self.endpoints: dict[str, EndpointRuntime] = {}
        self.canaries: dict[str, EndpointRuntime] = {}  # by label: a newer version on trial
        self.workers: dict[str, Worker] = {}
        # Nodes by name that take no new replicas (`ember node drain`), across the node's
        # reconnects and this process's restarts (in the store).
        self.draining_nodes: set[str] = set(store.list_draining_nodes())
        self.replicas: dict[str, Replica] = {}
        self.inputs: dict[str, Input] = {}
        # Synchronous calls made by the code of a live input, by that input's id.
        self.children: dict[str, set[Input]] = {}
        self.snapshots = snapshots or SnapshotRegistry(
            store, blobs or LocalBlobStore(config.blob_dir), config.snapshot_budget_bytes
        )
        self.snapshots.on_drop = functools.partial(image_dropped, self)
        self.metrics = PlatformMetrics()
        # Set by the server, which owns its HTTP client; None: no webhooks are sent.
        self.webhooks: WebhookSender | None = None
        self.spans: SpanExporter | None = None  # requests' spans to a collector, if set
        self.wake = asyncio.Event()  # something needs the controller now
        self.started_at = time.time()
        self.workers_version = 0  # bumped when a worker joins or leaves
        self.worker_left_at: float | None = None  # when a worker last left
        self._unservable: dict[str, tuple[tuple[int, Demand], str | None]] = {}

    # ----- deployments -------------------------------------------------------------
    def apply_deployment(self, deployment: Deployment) -> list[EndpointRuntime]:
        manifest = AppManifest.from_dict(deployment.manifest)
        seen = set()
        runtimes = []
        for spec in manifest.endpoints:
            label = make_label(manifest.app, spec.name)
            seen.add(label)
            runtime = self.endpoints.get(label)
            if runtime is None:
                runtime = EndpointRuntime(
                    manifest.app, spec, deployment.version, deployment.bundle_digest, manifest.entry
                )
                self.endpoints[label] = runtime
                runtime.deployed_at = deployment.created_at
            else:
                # Old replicas drain (controller); queued inputs wait for the new version.
                runtime.take_version(
                    spec,
                    deployment.version,
                    deployment.bundle_digest,
                    manifest.entry,
                    deployment.created_at,
                )
                self._fail_inputs_for_removed_methods(runtime)
            runtimes.append(runtime)
            self.logs.system(manifest.app, spec.name, f"deployed version {deployment.version}")
            if label in self.canaries:
                withdraw_canary(self, label, f"version {deployment.version} was deployed")
        for label, runtime in list(self.endpoints.items()):
            if runtime.app == manifest.app and label not in seen:
                self.remove_endpoint(label, "it was removed from the app")
        self.wake.set()
        return runtimes

    def runtimes(self) -> list[EndpointRuntime]:
        """Every endpoint's serving runtime, and the canaries beside them."""
        return [*self.endpoints.values(), *self.canaries.values()]

    def runtime_of(self, inp: Input) -> EndpointRuntime | None:
        """The runtime an input is for: its endpoint's canary if it was sent there and
        the canary still runs (else the serving version, which a promoted canary is)."""
        if inp.canary:
            canary = self.canaries.get(inp.label)
            if canary is not None:
                return canary
        return self.endpoints.get(inp.label)

    def set_scaling(self, runtime: EndpointRuntime, change: dict[str, Any]) -> None:
        """Change the endpoint's autoscaling settings until its next deploy (None for a
        setting: back to the deployed value); kept in the store across restarts.
        InvalidError when the result is not valid settings, with nothing changed."""
        override = merged(runtime.scaling_override, change)
        settings = effective_settings(runtime.spec.settings, override)
        if override:
            record = ScalingOverride(
                runtime.label, runtime.app, runtime.version, override, time.time()
            )
            self.store.put_scaling_override(record)
        else:
            self.store.delete_scaling_override(runtime.label)
        runtime.scaling_override = override
        runtime.overridden = settings if override else None
        deployed = runtime.spec.settings
        said = ", ".join(
            f"{name}={getattr(settings, name):g}"
            + (f" (deployed {getattr(deployed, name):g})" if name in override else " (as deployed)")
            for name in SCALABLE
        )
        self.logs.system(runtime.app, runtime.spec.name, f"scaling set: {said}")
        self.wake.set()

    def resume_deployments(self) -> list[str]:
        """At start: serve each app's stored version. One deployed under an older
        release whose checks let it through is left out, not the platform's start; the
        returned lines say which and what to fix (also in the app's log)."""
        refusals = []
        for deployment in self.store.latest_deployments():
            try:
                self.apply_deployment(deployment)
            except (InvalidError, TypeError, KeyError, ValueError) as exc:
                refusal = (
                    f"app {deployment.app} version {deployment.version} is not served: its "
                    f"manifest fails this release's checks ({exc}); fix it and deploy again"
                )
                self.logs.system(deployment.app, "", refusal)
                refusals.append(refusal)
        return refusals

    def restore_scaling(self) -> int:
        """At start: the stored overrides of the versions that serve; others are gone
        with the deploy that replaced their version."""
        restored = 0
        for record in self.store.list_scaling_overrides():
            runtime = self.endpoints.get(record.label)
            if runtime is None or runtime.version != record.version:
                with contextlib.suppress(StoreWriteError):
                    self.store.delete_scaling_override(record.label)
                continue
            try:
                runtime.overridden = effective_settings(runtime.spec.settings, record.settings)
            except (InvalidError, TypeError) as exc:
                log.warning("scaling override of %s dropped: %s", record.label, exc)
                continue
            runtime.scaling_override = dict(record.settings)
            restored += 1
        return restored

    def remove_app(self, app: str) -> int:
        labels = [label for label, r in self.endpoints.items() if r.app == app]
        for label in labels:
            self.remove_endpoint(label, f"app {app} was stopped")
        return len(labels)

    def remove_endpoint(self, label: str, reason: str) -> None:
        if label in self.canaries:
            withdraw_canary(self, label, reason)
        runtime = self.endpoints.pop(label)
        runtime.removed = True
        while runtime.pending:
            self.finish(
                runtime.pending.popleft(), Outcome.error(404, "not_found", f"{label}: {reason}")
            )
        for replica in list(runtime.replicas.values()):
            self.drain(replica)
        self.logs.system(runtime.app, runtime.spec.name, f"stopped: {reason}")

    # ----- inputs ------------------------------------------------------------------
    def unservable_reason(self, runtime: EndpointRuntime) -> str | None:
        """Why no worker could ever run this endpoint, or None.

        Right after a start, workers are still reconnecting: what is registered is not
        yet a verdict, so inputs queue for them instead. Likewise for a short while after
        a worker left: a restarting worker may be back soon, and it may be the one node
        that fits (its GPUs, its labels), whoever else is left.
        """
        now = time.time()
        grace = self.config.reconnect_grace_seconds
        if now - self.started_at < grace:
            return None
        if self.worker_left_at is not None and now - self.worker_left_at < grace:
            return None
        # Only the workers' totals matter, so the verdict holds until workers change.
        key = (self.workers_version, runtime.demand())
        cached = self._unservable.get(runtime.label)
        if cached is None or cached[0] != key:
            cached = (key, unservable_reason(runtime.demand(), self.capacities()))
            self._unservable[runtime.label] = cached
        return cached[1]

    def submit(self, inp: Input, *, recovered: bool = False) -> None:
        """Queue an input. `recovered`: an async call that a previous control-plane process
        accepted, so it skips the queue limit, and its record is in the store already."""
        runtime = self.runtime_of(inp)
        if runtime is None:
            raise UnknownEndpoint(f"no endpoint named {inp.label}")
        max_queue = runtime.settings.max_queue or self.config.max_queue
        if not recovered and len(runtime.pending) >= max_queue:
            self.metrics.request_turned_away(runtime.app, runtime.spec.name, 429)
            raise QueueFull(f"{inp.label} has {len(runtime.pending)} inputs queued; retry later")
        if inp.is_async and recovered:
            self._persist(inp, CallStatus.QUEUED)
        elif inp.is_async:
            try:
                self.calls.accept(self._call_record(inp, CallStatus.QUEUED))
            except StoreWriteError as error:
                raise DiskFull(
                    f"the call was not accepted, as the control plane could not record it "
                    f"({error}); retry once its state dir's disk has room",
                ) from None
        self.inputs[inp.id] = inp
        if inp.timeout is not None:
            inp.deadline_timer = asyncio.get_running_loop().call_later(
                inp.timeout, self._deadline_passed, inp
            )
        if inp.parent_id in self.inputs and not inp.is_async:
            # A call made for a live input: it ends when that input does (see `finish`).
            # A spawned call is the code's to keep.
            self.children.setdefault(inp.parent_id, set()).add(inp)
        self.enqueue(runtime, inp)
        self.dispatch(runtime)
        if runtime.pending:
            self.wake.set()

    def _fail_inputs_for_removed_methods(self, runtime: EndpointRuntime) -> None:
        """Queued inputs of a method the new version no longer has end with the 404 a new
        call of it gets, rather than reach code that lacks it (an AttributeError, a 500)."""
        listed = ", ".join(sorted(runtime.spec.methods)) or "none"
        for inp in [i for i in runtime.pending if i.method not in runtime.spec.methods]:
            runtime.pending.remove(inp)
            message = (
                f"version {runtime.version} of {runtime.label} was deployed while this call "
                f"waited, and has no method {inp.method!r} (it has: {listed})"
            )
            self.finish(inp, Outcome.error(404, "not_found", message))

    def cancel(self, inp: Input, reason: str) -> None:
        """The caller went away: drop the input, and stop it on its replica."""
        self._stop(inp, Outcome.error(499, "cancelled", reason))

    def _deadline_passed(self, inp: Input) -> None:
        """The call's own time limit is up, wherever it is: queued, running, or queued
        again after a lost replica."""
        replica = self.replicas.get(inp.replica_id or "")
        runtime = self.runtime_of(inp)
        if replica is not None and inp.id in replica.inflight:
            where = "running"
        elif runtime is not None and inp not in runtime.pending and inp.attempts:
            where = "waiting out its retry delay after its code raised"
        else:
            where = "waiting for a replica"
        message = (
            f"{inp.label} did not finish within the call's own timeout of {inp.timeout:g} s "
            f"(X-Ember-Timeout; it was {where}); it was stopped"
        )
        self._stop(inp, Outcome.error(504, "deadline_exceeded", message))

    def _stop(self, inp: Input, outcome: Outcome) -> None:
        """End the input with `outcome`: off its queue, or stopped on its replica."""
        if inp.done:
            return
        runtime = self.runtime_of(inp)
        if runtime is not None and inp in runtime.pending:
            runtime.pending.remove(inp)
        replica = self.replicas.get(inp.replica_id or "")
        self.finish(inp, outcome)
        if replica is not None and inp.id in replica.inflight:
            # The slot stays taken until the replica says the work stopped; if it never
            # does within the input's timeout, the replica is replaced.
            replica.send(frame({"type": "cancel", "id": inp.id}))
            inp.timer = asyncio.get_running_loop().call_later(
                replica.endpoint.settings.timeout, self._cancel_overdue, inp, replica
            )

    def _cancel_overdue(self, inp: Input, replica: Replica) -> None:
        if replica.inflight.pop(inp.id, None) is not None:
            for other in replica.inflight.values():
                other.attempts -= 1  # not their fault; do not charge a retry
            self.replica_lost(replica, f"input {inp.id} did not stop after it was cancelled")

    def dispatch(self, runtime: EndpointRuntime) -> None:
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

    def _assign(self, inp: Input, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        if inp.timer is not None:  # its queue timeout
            inp.timer.cancel()
        inp.replica_id = replica.id
        inp.attempts += 1
        inp.dispatched_at = time.time()
        replica.inflight[inp.id] = inp
        replica.idle_since = None
        replica.assigned += 1
        limit = replica.endpoint.settings.max_inputs
        if limit is not None and replica.assigned >= limit:
            self._retire_after_inputs(replica, limit)
        inp.timer = loop.call_later(
            replica.endpoint.settings.timeout,
            self._on_timeout,
            inp,
            replica.endpoint.settings.timeout,
        )
        header: dict[str, Any] = {"type": "input", "id": inp.id, "method": inp.method}
        if inp.streaming:  # read by methods whose stream flag decides per call
            header["stream"] = True
        if inp.affinity is not None:  # ember.current_affinity_key() in the code
            header["affinity"] = inp.affinity
        if inp.trace is not None:  # its calls join the trace, as spans of this one
            header["trace"] = inp.trace.traceparent
        replica.send(frame(header, inp.body))
        if inp.inbox:  # a WebSocket's messages that came while it queued
            for message in inp.inbox:
                replica.send(frame({"type": "message", "id": inp.id}, message))
            inp.inbox = None
        if inp.is_async:
            self._persist(inp, CallStatus.RUNNING)

    def send_to_input(self, inp: Input, message: bytes) -> None:
        """A message for a running input (a WebSocket session's, from its caller): to its
        replica, or held until one takes it."""
        if inp.done:
            return
        replica = self.replicas.get(inp.replica_id or "")
        if replica is None or inp.id not in replica.inflight:
            inp.inbox = [*(inp.inbox or []), message]
            return
        replica.send(frame({"type": "message", "id": inp.id}, message))

    async def next_event(self, inp: Input) -> tuple[str, bytes | None]:
        """A synchronous stream's next item for its caller. What was taken is acknowledged
        to the replica, which otherwise stops a window ahead of the caller."""
        item = await inp.next_event()
        self._acknowledge(inp)
        return item

    def _acknowledge(self, inp: Input) -> None:
        if inp.taken_bytes - inp.acked_bytes < STREAM_ACK_BYTES:
            return
        inp.acked_bytes = inp.taken_bytes
        replica = self.replicas.get(inp.replica_id or "")
        if replica is not None and inp.id in replica.inflight:
            replica.send(frame({"type": "ack", "id": inp.id, "bytes": inp.taken_bytes}))

    def _collect(self, inp: Input, data: bytes, size: int) -> None:
        """Keep an event of a spawned stream for its one result, within a result's limit:
        nobody reads it as it comes, so it cannot hold the generator back."""
        inp.collected.append(data)
        inp.collected_bytes += len(data) + 1  # with the comma of the JSON list
        limit = MAX_FILE_RESULT_BYTES if inp.file is not None else MAX_RESULT_BYTES
        if inp.collected_bytes > limit:
            inp.collected = []
            message = (
                f"{inp.label} streamed more than {limit // MIB} MiB to a spawned call, which "
                "keeps the stream as one result: call it with .stream() to read it as it "
                "comes, or store what it makes and return where it is"
            )
            runtime = self.runtime_of(inp)
            if runtime is not None:
                self.logs.system(runtime.app, runtime.spec.name, message, inp.replica_id)
            self._stop(inp, Outcome.error(500, "result_too_large", message))
            return
        inp.taken_bytes += size
        self._acknowledge(inp)

    def finish(self, inp: Input, outcome: Outcome) -> None:
        if inp.done:
            return
        inp.done = True
        if inp.timer is not None:
            inp.timer.cancel()
        if inp.deadline_timer is not None:
            inp.deadline_timer.cancel()
        self.inputs.pop(inp.id, None)
        if inp.parent_id is not None:
            siblings = self.children.get(inp.parent_id)
            if siblings is not None:
                siblings.discard(inp)
                if not siblings:
                    del self.children[inp.parent_id]
        self._end_children(inp, f"the call that made it, {inp.id}, has ended")
        if inp.streaming and not inp.is_async:
            inp.add_event(*((END, None) if outcome.status == 200 else ("error", outcome.body)))
        if not inp.outcome.done():
            inp.outcome.set_result(outcome)
        if inp.is_async:
            status = CallStatus.SUCCEEDED if outcome.status == 200 else CallStatus.FAILED
            if self.spans is not None:
                self.spans.record_call(inp, outcome.status)
            record = self._persist(inp, status, outcome)
            if record.webhook is not None and self.webhooks is not None:
                self.webhooks.deliver(record)

    def _end_children(self, inp: Input, reason: str) -> None:
        """Cancel the synchronous calls `inp`'s code made: nobody waits for their answers
        any more (the caller was that code)."""
        for child in self.children.pop(inp.id, ()):
            self.cancel(child, reason)

    def _persist(
        self, inp: Input, status: CallStatus, outcome: Outcome | None = None
    ) -> CallRecord:
        record = self._call_record(inp, status, outcome)
        self.calls.put(record)
        return record

    def webhook_ended(self, record: CallRecord, state: str) -> None:
        """A webhook was delivered, or given up on: kept in the call's record (unless the
        record has gone meanwhile), so that a restart does not send it again."""
        if self.calls.get(record.id) is not None:
            self.calls.put(dataclasses.replace(record, webhook_state=state))

    def resume_webhooks(self) -> int:
        """Send again the webhooks a previous control-plane process left undelivered."""
        if self.webhooks is None:
            return 0
        pending = self.store.pending_webhooks()
        for record in pending:
            self.webhooks.deliver(record)
        return len(pending)

    @staticmethod
    def _call_record(inp: Input, status: CallStatus, outcome: Outcome | None = None) -> CallRecord:
        return CallRecord(
            id=inp.id,
            label=inp.label,
            method=inp.method,
            body=inp.body,
            status=status,
            attempts=inp.attempts,
            created_at=inp.created_at,
            finished_at=time.time() if outcome else None,
            http_status=outcome.status if outcome else None,
            result=outcome.body if outcome else None,
            media_type=outcome.media_type if outcome else None,
            filename=outcome.filename if outcome else None,
            webhook=inp.webhook,
            webhook_state=WEBHOOK_PENDING if outcome and inp.webhook else None,
        )

    def _on_timeout(self, inp: Input, seconds: float) -> None:
        replica = self.replicas.get(inp.replica_id or "")
        outcome = Outcome.error(
            504, "timeout", f"{inp.label} ran longer than its timeout of {seconds:g} s"
        )
        method = replica.endpoint.spec.methods.get(inp.method) if replica is not None else None
        if method is not None and method.is_async:
            # A coroutine can be cancelled where it waits: only it stops, and the inputs
            # beside it (a web app's other requests) run on.
            self._stop(inp, outcome)
            return
        self.finish(inp, outcome)
        if replica is not None:
            replica.inflight.pop(inp.id, None)
            # A sync function cannot be interrupted inside its thread: replace the replica.
            for other in replica.inflight.values():
                other.attempts -= 1  # not their fault; do not charge a retry
            self.replica_lost(replica, f"input {inp.id} timed out; the replica is replaced")

    def _retry_or_fail(self, inp: Input, reason: str) -> None:
        if inp.done:
            return
        if inp.timer is not None:
            inp.timer.cancel()
        inp.replica_id = None
        runtime = self.runtime_of(inp)
        if runtime is None:
            self.finish(inp, Outcome.error(404, "not_found", f"{inp.label} was stopped"))
        elif inp.emitted:
            self.finish(
                inp,
                Outcome.error(502, "replica_lost", f"the stream was interrupted: {reason}"),
            )
        elif inp.attempts > runtime.settings.retries:
            self.finish(
                inp,
                Outcome.error(
                    502,
                    "replica_lost",
                    f"{reason}; gave up after {inp.attempts} attempts "
                    f"(retries={runtime.settings.retries})",
                ),
            )
        else:
            self._end_children(inp, RUN_ENDED.format(inp.id))
            self.enqueue(runtime, inp, front=True)
            if inp.is_async:
                self._persist(inp, CallStatus.QUEUED)
            self.logs.system(runtime.app, runtime.spec.name, f"input {inp.id} requeued: {reason}")
            self.dispatch(runtime)
            self.wake.set()

    def _retry_after_error(self, inp: Input, status: int, error_type: str, message: str) -> bool:
        """With `retries=Retries(...)`, an input whose code raised runs again after its
        backoff, until its retries are spent. Returns whether it will."""
        runtime = self.runtime_of(inp)
        if (
            runtime is None
            or runtime.settings.retry_backoff is None
            or status != 500
            or error_type in NOT_RETRIED_ERRORS
            or inp.emitted  # the caller has part of a stream already
            or inp.attempts > runtime.settings.retries
        ):
            return False
        delay = retry_delay(runtime.settings.retry_backoff, inp.attempts)
        inp.replica_id = None
        self._end_children(inp, RUN_ENDED.format(inp.id))
        if inp.is_async:
            self._persist(inp, CallStatus.QUEUED)
        self.logs.system(
            runtime.app,
            runtime.spec.name,
            f"input {inp.id} raised {error_type}: {message[:200]}; retrying in {delay:g} s "
            f"(retry {inp.attempts} of {runtime.settings.retries})",
        )
        # A cancel meanwhile finishes the input, which cancels this timer.
        inp.timer = asyncio.get_running_loop().call_later(delay, self._requeue, inp)
        return True

    def _requeue(self, inp: Input) -> None:
        if inp.done:
            return
        runtime = self.runtime_of(inp)
        if runtime is None:
            self.finish(inp, Outcome.error(404, "not_found", f"{inp.label} was stopped"))
            return
        self.enqueue(runtime, inp, front=True)
        self.dispatch(runtime)
        self.wake.set()

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
            loop = asyncio.get_running_loop()
            inp.timer = loop.call_later(limit, self._queue_expired, runtime, inp, limit)

    def _queue_expired(self, runtime: EndpointRuntime, inp: Input, limit: float) -> None:
        if inp.done or inp not in runtime.pending:
            return
        runtime.pending.remove(inp)
        self.finish(
            inp,
            Outcome.error(
                504,
                "queue_timeout",
                f"{inp.label} had no replica free to take it within queue_timeout={limit:g} s "
                f"(its max_replicas={runtime.settings.max_replicas} were busy or starting); "
                "retry later",
            ),
        )

    # ----- replicas ----------------------------------------------------------------
    def replica_env(self, runtime: EndpointRuntime) -> dict[str, str]:
        """The endpoint's own variables, then its secrets' (which win)."""
        return {**runtime.settings.env, **self.secrets.env_for(runtime.settings.secrets)}

    def demand_of(self, runtime: EndpointRuntime) -> Demand:
        """What a new replica of `runtime` needs, and the nodes that hold the snapshot
        image it would restore from or some of its weights (the scheduler prefers them)."""
        images = self.snapshots.images_at(
            runtime,
            self.workers.values(),
            env_digest(self.replica_env(runtime)),
            runtime.settings.gpu_choices or (None,),
        )
        urls = runtime.settings.weights.values()
        weights = frozenset(
            (worker.id, held)
            for worker in self.workers.values()
            if (held := weights_bytes_held(urls, worker.cached_weights))
        )
        return dataclasses.replace(runtime.demand(), images_at=images, weights_at=weights)

    def start_replica(
        self, runtime: EndpointRuntime, worker: Worker, gpu: GpuChoice | None = None
    ) -> Replica:
        """Start a replica on `worker`, holding `gpu` (type, count): the endpoint's GPU
        choice the scheduler placed it with (by default its first)."""
        if gpu is None and runtime.settings.gpu_choices:
            gpu = runtime.settings.gpu_choices[0]
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
        self.replicas[replica.id] = replica
        runtime.replicas[replica.id] = replica
        env = self.replica_env(runtime)
        snapshot, note = self.snapshots.plan(runtime, worker, replica.id, env_digest(env), gpu)
        if snapshot is not None and snapshot["action"] == "restore":
            replica.restoring_from = (snapshot["key"], snapshot["image_id"])
        if note and note != runtime.snapshot_note:
            runtime.snapshot_note = note
            self.logs.system(runtime.app, runtime.spec.name, note)
        else:
            note = None  # said once already
        worker.send(
            {
                "snapshot": snapshot,
                "snapshot_note": note,
                "type": "start_replica",
                "replica_id": replica.id,
                "token": replica.token,
                "call_token": replica.call_token,
                "app": runtime.app,
                "endpoint": runtime.spec.name,
                "label": runtime.label,
                "version": runtime.version,
                "bundle_digest": runtime.bundle_digest,
                "entry": runtime.entry,
                "attribute": runtime.spec.attribute,
                "concurrency": runtime.settings.concurrency,
                "memory": runtime.settings.memory,  # MiB, named if the OOM killer ends it
                "memory_limit": runtime.settings.memory_limit,  # MiB, a cgroup's hard cap
                "cpu_limit": runtime.settings.cpu_limit,  # CPUs, a cgroup's CFS quota
                "requirements": runtime.settings.requirements,  # pip lines, with the app's
                "env": env,  # its env= and its secrets' variables
                # The node picks which of its GPUs; the scheduler checked it has enough.
                "gpu_type": gpu[0] if gpu else None,
                "gpu_count": gpu[1] if gpu else 0,
            }
        )
        worker.bundles.add(runtime.bundle_digest)
        self.logs.system(
            runtime.app, runtime.spec.name, f"starting replica on worker {worker.name}", replica.id
        )
        return replica

    def replica_message(self, replica: Replica, text: str) -> None:
        replica.last_seen = time.time()
        header_text, _, body = text.partition("\n")
        header = json.loads(header_text)
        kind = header["type"]
        if kind == "heartbeat":
            runtime = replica.endpoint
            weights = header.get("weights")
            if isinstance(weights, dict):
                self.metrics.weights_read(replica.id, runtime.app, runtime.spec.name, weights)
            user = header.get("metrics")
            if isinstance(user, list):
                self.metrics.user.report(replica.id, runtime.app, runtime.spec.name, user)
            return
        if kind == "ready":
            self._replica_ready(replica, dict(header.get("start") or {}))
            return
        if kind == "startup_failed":
            message = f"{header.get('error_type', 'Error')}: {header.get('message', '')}"
            self._startup_failed(replica.endpoint, message)
            self.replica_lost(replica, "its enter() hook failed", startup_failure=False)
            return
        if kind == "unhealthy":
            self._replica_unhealthy(replica, str(header.get("reason", "")))
            return
        if replica.held is not None:
            replica.held.append(text)
            return
        inp = replica.inflight.get(header.get("id", ""))
        if inp is None:
            return  # finished already (timeout, cancel): late output is dropped
        body_bytes = body.encode()
        if kind == "event":
            if inp.done:
                return  # stopped (timeout, cancel): only its end still counts, for the slot
            inp.emitted = True
            event_kind = EVENT
            if "media_type" in header:  # a chunk of a stream that is a file
                event_kind, body_bytes = CHUNK, base64.b64decode(body_bytes)
                if inp.file is None:
                    inp.file = received_file_header(header)
            if inp.is_async:
                self._collect(inp, body_bytes, len(body))
            else:
                inp.add_event(event_kind, body_bytes, len(body))
            return
        del replica.inflight[inp.id]
        if inp.timer is not None:
            inp.timer.cancel()
        if replica.served == 0 and inp.dispatched_at is not None:
            # The first input shows what is still cold after a start (lazy init, caches).
            seconds = round(time.time() - inp.dispatched_at, 4)
            replica.start["first_input_seconds"] = seconds
            self._start_phase(replica, "first_input", seconds)
        replica.served += 1
        if kind == "result" and "media_type" in header:  # a file: base64 on the channel
            self.finish(
                inp, Outcome(200, base64.b64decode(body_bytes), *received_file_header(header))
            )
        elif kind == "result":
            self.finish(inp, Outcome(200, body_bytes))
        elif kind == "end" and inp.is_async and inp.file is not None:
            # A spawned call's file stream is kept as one file.
            self.finish(inp, Outcome(200, b"".join(inp.collected), *inp.file))
        elif kind == "end":
            payload = b"[" + b",".join(inp.collected) + b"]" if inp.is_async else b""
            self.finish(inp, Outcome(200, payload))
        elif kind == "error":
            status, error_type = int(header.get("status", 500)), header["error_type"]
            if not self._retry_after_error(inp, status, error_type, header["message"]):
                self.finish(inp, Outcome.error(status, error_type, header["message"]))
        elif kind == "cancelled" and not inp.done:
            # Only the platform cancels (the input ended then); this one the replica
            # stopped by itself, and its caller must not wait for ever.
            message = f"{inp.label}: the replica stopped the input without being asked to"
            self.finish(inp, Outcome.error(500, "CancelledError", message))
        self._slot_freed(replica)

    def _replica_ready(self, replica: Replica, start: dict[str, Any]) -> None:
        if replica.state is not ReplicaState.STARTING:
            return
        now = time.time()
        replica.state = ReplicaState.READY
        replica.ready_at = now
        replica.idle_since = now
        runtime = replica.endpoint
        runtime.startup_failures = 0
        runtime.last_startup_error = ""
        phases = {
            key: round(float(value), 4)
            for key, value in start.items()
            if key.endswith("_seconds") and isinstance(value, int | float)
        }
        replica.start = {
            "kind": str(start.get("kind", "cold")),
            "total_seconds": round(now - replica.created_at, 4),
            **phases,
            **replica.start,  # a lazy restore's memory may be all in before `ready`
        }
        runtime.last_start = replica.start
        if start.get("memory_pending"):
            replica.start["lazy"] = True
            if "memory_in_seconds" not in replica.start:
                # It runs while its memory arrives. Should CRIU's page daemon fail, the
                # kernel hands it zeroed pages until the agent kills it, so nothing it
                # sends about an input counts until its memory is in; if it never is, the
                # replica is lost and its inputs are retried as for any lost replica.
                replica.held = []
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
        if replica.version != runtime.version or runtime.removed:
            self.drain(replica)
        else:
            self.dispatch(runtime)

    def _replica_unhealthy(self, replica: Replica, reason: str) -> None:
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
        self.wake.set()  # the autoscaler starts its replacement now, not on the next tick

    def _retire_after_inputs(self, replica: Replica, limit: int) -> None:
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
        self.wake.set()  # a replacement for what waits starts now, not on the next tick

    def _slot_freed(self, replica: Replica) -> None:
        if not replica.inflight:
            replica.idle_since = time.time()
            if replica.state is ReplicaState.DRAINING:
                self.stop(replica)
                return
        if replica.state is ReplicaState.READY:
            self.dispatch(replica.endpoint)

    def _startup_failed(self, runtime: EndpointRuntime, message: str) -> None:
        runtime.startup_failures += 1
        runtime.last_startup_error = message
        runtime.backoff_until = time.time() + min(30.0, 0.5 * 2**runtime.startup_failures)
        self.logs.system(runtime.app, runtime.spec.name, f"replica failed to start: {message}")
        if runtime.startup_failures >= STARTUP_FAILURES_BEFORE_GIVING_UP:
            while runtime.pending:
                self.finish(
                    runtime.pending.popleft(),
                    Outcome.error(
                        500,
                        "replica_start_failed",
                        f"replicas of {runtime.label} fail to start: {message} "
                        f"(see `ember logs {runtime.app}`)",
                    ),
                )

    def drain(self, replica: Replica) -> None:
        """Take no new inputs; stop once the inputs in flight are done."""
        if replica.state is ReplicaState.STARTING:
            self.replica_lost(replica, "no longer needed while starting", startup_failure=False)
        elif replica.state is ReplicaState.READY:
            replica.state = ReplicaState.DRAINING
            if not replica.inflight:
                self.stop(replica)

    def stop(self, replica: Replica) -> None:
        replica.state = ReplicaState.STOPPING
        worker = self.workers.get(replica.worker_id)
        if worker is not None:
            worker.send(
                {
                    "type": "stop_replica",
                    "replica_id": replica.id,
                    "grace": self.config.stop_grace_seconds,
                }
            )
        runtime = replica.endpoint
        self.logs.system(runtime.app, runtime.spec.name, "replica stopping", replica.id)

    def kill(self, replica: Replica, reason: str) -> None:
        self.replica_lost(replica, reason)

    def replica_disconnected(self, replica: Replica) -> None:
        replica.outbox = None
        if replica.id not in self.replicas:
            return
        if replica.state is ReplicaState.STOPPING and not replica.inflight:
            # Kept until its worker reports the process gone: until then it still holds
            # the node's CPU, memory and GPUs, which must not be handed to a new replica.
            return
        # Mostly the process ended, and its worker's report of how (an exit code, a
        # signal, the OOM killer) comes within milliseconds: callers and logs get that
        # rather than a closed connection. No input is sent to it meanwhile (no outbox).
        grace = self.config.exit_report_grace_seconds
        if grace <= 0:
            self._channel_lost(replica)
        elif replica.disconnect_timer is None:
            loop = asyncio.get_running_loop()
            replica.disconnect_timer = loop.call_later(grace, self._channel_lost, replica)

    def _channel_lost(self, replica: Replica) -> None:
        replica.disconnect_timer = None
        if self.replicas.get(replica.id) is replica:
            self.replica_lost(replica, "its connection to the control plane closed", crashed=True)

    def replica_lost(
        self, replica: Replica, reason: str, *, startup_failure: bool = True, crashed: bool = False
    ) -> None:
        """The replica is gone or must go: kill it and requeue (or fail) its inputs. When
        it `crashed` (its process ended, unasked) with several inputs in flight, any one of
        them may have done it: none is charged the attempt, and each runs again alone, so
        that one which crashes replicas fails by its own retries, not its neighbours'."""
        if replica.id not in self.replicas:
            return
        runtime = replica.endpoint
        if replica.state is ReplicaState.STARTING and startup_failure:
            self._startup_failed(runtime, reason)
        self._forget(replica)
        worker = self.workers.get(replica.worker_id)
        if worker is not None:
            worker.send({"type": "kill_replica", "replica_id": replica.id})
        self.logs.system(runtime.app, runtime.spec.name, f"replica lost: {reason}", replica.id)
        inflight = list(replica.inflight.values())
        replica.inflight.clear()
        if crashed and len(inflight) > 1:
            for inp in inflight:
                if not inp.suspect:
                    inp.suspect = True
                    inp.attempts -= 1  # counted once it runs alone
        # Requeued at the front one by one: reversed, so they keep their order.
        for inp in reversed(inflight):
            self._retry_or_fail(inp, f"replica {replica.id} was lost ({reason})")
        self.wake.set()

    def request_finished(self, stats: RequestStats, inp: Input, status: int) -> None:
        """A synchronous request ended with `status`: its latencies into the metrics, its
        line into the app's log (written at the next tick)."""
        queued = None if inp.dispatched_at is None else inp.dispatched_at - inp.created_at
        stats.finish(status, inp.replica_id, queued)
        self.metrics.request_finished(stats)
        if inp.canary or inp.label in self.canaries:  # a canary's two sides, compared
            runtime = self.runtime_of(inp)
            if runtime is not None:
                runtime.outcomes.note(status, stats.e2e_seconds)
            self.metrics.version_request_finished(stats, "canary" if inp.canary else "serving")
        self.logs.buffer(stats.app, stats.log_entry())
        if self.spans is not None:
            self.spans.record(stats)

    def _start_phase(self, replica: Replica, phase: str, seconds: float) -> None:
        runtime = replica.endpoint
        kind = str(replica.start.get("kind", "cold"))
        self.metrics.start_phase(runtime.app, runtime.spec.name, kind, phase, seconds)

    def usage_of(self, replica: Replica, until: float) -> ReplicaUsage:
        """What the replica has held from its placement until `until`."""
        runtime = replica.endpoint
        gpu_type, gpu_count = replica.gpu if replica.gpu is not None else (None, 0)
        return ReplicaUsage(
            replica_id=replica.id,
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
        for replica in list(self.replicas.values()):
            try:
                self.store.put_usage(self.usage_of(replica, now))
            except StoreWriteError as error:
                log.warning("usage of replica %s not recorded: %s", replica.id, error)
                continue
            recorded += 1
        self.replicas.clear()  # recorded once: nothing may write them again
        return recorded

    def _forget(self, replica: Replica) -> None:
        if replica.id in self.replicas:  # once, however many paths lead here
            try:
                self.store.put_usage(self.usage_of(replica, time.time()))
            except StoreWriteError as error:  # an account, not state: it may lose one
                log.warning("usage of replica %s not recorded: %s", replica.id, error)
        if replica.disconnect_timer is not None:
            replica.disconnect_timer.cancel()
            replica.disconnect_timer = None
        self.snapshots.replica_gone(replica.id)
        self.replicas.pop(replica.id, None)
        replica.endpoint.replicas.pop(replica.id, None)
        self.metrics.forget_replica(replica.id)
        if replica.outbox is not None:
            replica.outbox.put_nowait("")  # tells the writer to close the channel

    # ----- workers -----------------------------------------------------------------
    def register_worker(self, hello: dict[str, Any]) -> Worker:
        """A worker's hello. ValueError when another live process has its name: node
        names pick nodes (`ember node drain`, listings), so two may not share one."""
        name = str(hello.get("name") or "worker")
        instance = str(hello.get("instance") or "")
        for other in list(self.workers.values()):
            if other.name != name or not instance:
                continue
            if other.instance == instance:
                # The same agent, back before its old channel was seen to close.
                self.worker_gone(other, "reconnected")
            else:
                raise WorkerNameTaken(
                    f"a worker named {name!r} is already joined (pid "
                    f"{other.pid or '?'}); start this one with another --name"
                )
        worker = Worker(
            id="w-" + secrets.token_hex(4),
            name=name,
            cpu=float(hello["cpu"]),
            memory=int(hello["memory"]),
            gpus={str(k): int(v) for k, v in dict(hello.get("gpus") or {}).items()},
            bundles=set(hello.get("bundles") or []),
            snapshots=dict(hello.get("snapshots") or {}),
            memory_limits_problem=hello.get("memory_limits_problem"),
            cpu_limits_problem=hello.get("cpu_limits_problem"),
            labels={str(k): str(v) for k, v in dict(hello.get("labels") or {}).items()},
            instance=instance,
            pid=hello.get("pid") if type(hello.get("pid")) is int else None,
        )
        self.workers[worker.id] = worker
        self.workers_version += 1
        self.wake.set()
        offer_snapshots(self, worker)  # sent once it is welcomed, before any replica
        return worker

    def worker_message(self, worker: Worker, payload: dict[str, Any]) -> None:
        worker.last_seen = time.time()
        kind = payload.get("type")
        if kind == "heartbeat":
            worker.gpu_samples = [g for g in payload.get("gpus") or [] if isinstance(g, dict)]
            for replica_id, used in dict(payload.get("replica_memory") or {}).items():
                replica = self.replicas.get(str(replica_id))
                if replica is not None and replica.worker_id == worker.id and type(used) is int:
                    replica.memory_bytes = used
            for replica_id, waited in dict(payload.get("replica_cpu_throttled") or {}).items():
                replica = self.replicas.get(str(replica_id))
                if (
                    replica is not None
                    and replica.worker_id == worker.id
                    and isinstance(waited, int | float)
                ):
                    replica.cpu_throttled_seconds = float(waited)
            cached = payload.get("cached_snapshots")
            if isinstance(cached, list):  # sent when it changed
                worker.cached_snapshots = {
                    (str(pair[0]), str(pair[1]))
                    for pair in cached
                    if isinstance(pair, list) and len(pair) == 2
                }
            weights = payload.get("cached_weights")
            if isinstance(weights, dict):  # sent when it changed
                worker.cached_weights = {
                    str(url): size for url, size in weights.items() if type(size) is int
                }
        elif kind == "replica_exited":
            replica = self.replicas.get(str(payload.get("replica_id")))
            if replica is not None:
                detail = payload.get("detail") or f"exit code {payload.get('returncode')}"
                if replica.state is ReplicaState.STOPPING and not replica.inflight:
                    self._forget(replica)
                else:
                    self.replica_lost(replica, f"its process ended ({detail})", crashed=True)
        elif kind == "leaving":
            # Stopped by its operator: what its replicas run finishes, nothing new goes there.
            worker.leaving = True
            self._drain_replicas_on({worker.id}, f"worker {worker.name} is leaving")
        elif kind == "replica_memory_in":
            # A lazily restored replica's memory is all in: part of how it started.
            replica = self.replicas.get(str(payload.get("replica_id")))
            if replica is not None and not payload.get("error"):
                seconds = round(float(payload["seconds"]), 4)
                replica.start["memory_in_seconds"] = seconds
                if replica.state is not ReplicaState.STARTING:  # else counted at `ready`
                    self._start_phase(replica, "memory_in", seconds)
                held, replica.held = replica.held or [], None
                for text in held:
                    self.replica_message(replica, text)
        elif kind in SNAPSHOT_EVENTS or kind in QUIET_SNAPSHOT_REPORTS:
            snapshot_event(self, worker, kind, payload)
        elif kind in ("exec_output", "exec_exit"):
            self.execs.message(worker, payload)
        elif kind == "logs":
            by_app: dict[str, list[dict[str, Any]]] = {}
            for entry in payload.get("entries", []):
                by_app.setdefault(str(entry.get("app", "")), []).append(entry)
            for app, entries in by_app.items():
                if app:
                    self.logs.write(app, entries)

    def secret_changed(self, name: str) -> None:
        """Drop the images of endpoints that use the secret: they hold its old values.
        (Their keys would not match again anyway; this frees the space at once.)"""
        for label in self.secret_users(name):
            for record in self.snapshots.for_label(label):
                self.snapshots.drop(record.key)

    def secret_users(self, name: str) -> list[str]:
        """Labels of the deployed endpoints that ask for the secret."""
        return sorted({r.label for r in self.runtimes() if name in r.settings.secrets})

    def collect_snapshots(self) -> None:
        current = {(r.label, r.bundle_digest) for r in self.runtimes()}
        for key in self.snapshots.collect_garbage(current):
            log.info("snapshot %s collected", key)

    def drain_node(self, name: str) -> int:
        """`ember node drain`: the node's replicas finish what they run and stop, and no new
        ones are placed there until `uncordon_node`; the autoscaler starts replacements on
        other nodes. How many replicas drain."""
        ids = {w.id for w in self.workers.values() if w.name == name}
        self.store.put_draining_node(name, time.time())  # StoreWriteError: a 503, no drain
        self.draining_nodes.add(name)
        return self._drain_replicas_on(ids, f"node {name} is draining")

    def _drain_replicas_on(self, worker_ids: set[str], why: str) -> int:
        live = (ReplicaState.STARTING, ReplicaState.READY)
        draining = [
            r for r in self.replicas.values() if r.worker_id in worker_ids and r.state in live
        ]
        for replica in draining:
            self.logs.system(replica.endpoint.app, replica.endpoint.spec.name, why, replica.id)
            self.drain(replica)
        self.wake.set()  # replacements start elsewhere now, not on the next tick
        return len(draining)

    def replicas_by_worker(self) -> dict[str, int]:
        """How many replicas (in any state) each worker holds, by worker id."""
        counts: dict[str, int] = {}
        for replica in self.replicas.values():
            counts[replica.worker_id] = counts.get(replica.worker_id, 0) + 1
        return counts

    def takes_no_replicas(self, worker: Worker) -> bool:
        """Whether the worker's node is drained, or the worker itself is leaving."""
        return worker.leaving or worker.name in self.draining_nodes

    def uncordon_node(self, name: str) -> bool:
        """New replicas may go to the node again; False if it was not draining."""
        if name not in self.draining_nodes:
            return False
        self.store.delete_draining_node(name)
        self.draining_nodes.discard(name)
        self.wake.set()
        for worker in self.workers.values():
            if worker.name == name:
                offer_snapshots(self, worker)
        return True

    def worker_gone(self, worker: Worker, reason: str) -> None:
        if self.workers.pop(worker.id, None) is None:
            return
        self.workers_version += 1
        self.snapshots.worker_gone(worker.id)
        self.execs.worker_gone(worker, reason)
        self.worker_left_at = time.time()
        for replica in [r for r in self.replicas.values() if r.worker_id == worker.id]:
            # Not the replica's fault: it starts again elsewhere without a failure counted.
            self.replica_lost(replica, f"worker {worker.name} {reason}", startup_failure=False)
        worker.outbox.put_nowait("")

    def capacities(self) -> list[NodeCapacity]:
        nodes = []
        for worker in self.workers.values():
            cpu_used = 0.0
            memory_used = 0
            gpus_used: dict[str, int] = {}
            live: dict[str, int] = {}
            for replica in self.replicas.values():
                if replica.worker_id != worker.id:
                    continue
                settings = replica.endpoint.settings
                cpu_used += settings.cpu
                memory_used += settings.memory
                if replica.gpu is not None:
                    kind, count = replica.gpu
                    gpus_used[kind] = gpus_used.get(kind, 0) + count
                if replica.state in (ReplicaState.STARTING, ReplicaState.READY):
                    label = replica.endpoint.label
                    live[label] = live.get(label, 0) + 1
            nodes.append(
                NodeCapacity(
                    worker.id,
                    worker.cpu,
                    worker.memory,
                    worker.gpus,
                    cpu_used,
                    memory_used,
                    gpus_used,
                    frozenset(worker.bundles),
                    live,
                    worker.labels,
                    self.takes_no_replicas(worker),
                )
            )
        return nodes

    # ----- async calls -------------------------------------------------------------
    def recover_calls(self) -> int:
        """Requeue the async calls a previous control-plane process left unfinished."""
        count = 0
        for record in self.store.unfinished_calls():
            runtime = self.endpoints.get(record.label)
            method = runtime.spec.methods.get(record.method) if runtime else None
            inp = Input(
                id=record.id,
                label=record.label,
                method=record.method,
                body=record.body,
                streaming=bool(method and method.streams(json.loads(record.body or b"{}"))),
                is_async=True,
                attempts=record.attempts,
                created_at=record.created_at,
                webhook=record.webhook,
            )
            if runtime is None or method is None:
                self.finish(inp, Outcome.error(404, "not_found", f"{record.label} was stopped"))
            elif record.status is CallStatus.RUNNING and inp.attempts > runtime.settings.retries:
                self.finish(
                    inp,
                    Outcome.error(502, "replica_lost", "the control plane restarted mid-run"),
                )
            else:
                self.submit(inp, recovered=True)
                count += 1
        return count
