"""An input from its submission to its outcome: admitted to its endpoint's queue (or
refused), ended by its result, its caller's cancel, its own deadline or its endpoint's
timeout, run again when its replica is lost or (with `retries=`) its code raised, and
ending with it the calls its code made.

The queue itself, and the handing of inputs to replicas, is `Queues` (queues.py), which
this part builds with the handlers of its timers.
"""

from __future__ import annotations

import json
import time

from ember.declarations.retries import retry_delay
from ember.wire import messages as wire
from ember.wire.labels import split_app_key
from ember_platform.calls.journal import CallJournal
from ember_platform.config import ServerConfig
from ember_platform.core.queues import Queues
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.errors import QueueFull, UnknownEndpoint, WorkspaceLimitReached
from ember_platform.limits.admission import Admission, load_needed
from ember_platform.limits.workspace_limits import WorkspaceLimitRegistry
from ember_platform.observability.engine_metrics import EngineMetrics
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics, call_kind
from ember_platform.runtime.cluster_model import EndpointRuntime, Replica, ReplicaState
from ember_platform.runtime.inputs import (
    END,
    ERROR,
    Input,
    InputPhase,
    Outcome,
    hold_body,
    is_batch_call,
)
from ember_platform.runtime.live_state import LiveState
from ember_platform.storage.records import CallStatus

# Why a call made by an input's code is cancelled when that run of the input ends but the
# input is retried: its new run makes its own calls.
RUN_ENDED = "the run of {} that made it has ended; it runs again"

# Errors of inputs whose code raised that a retry would not mend.
NOT_RETRIED_ERRORS = frozenset({"result_too_large"})


class InputLifecycle:
    def __init__(
        self,
        state: LiveState,
        config: ServerConfig,
        replicas: ReplicaLifecycle,
        journal: CallJournal,
        logs: LogSink,
        metrics: PlatformMetrics,
        limits: WorkspaceLimitRegistry,
        engine_metrics: EngineMetrics | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self.replicas = replicas
        self.journal = journal
        self.logs = logs
        self.metrics = metrics
        self.limits = limits
        self.admission = Admission()
        self.queues = Queues(
            state,
            replicas,
            journal,
            metrics,
            finish=self.finish,
            run_timed_out=self._on_timeout,
            engine_metrics=engine_metrics,
        )

    def submit(self, inp: Input, *, recovered: bool = False) -> None:
        """Queue an input: UnknownEndpoint, QueueFull, WorkspaceLimitReached, or (an async
        call whose record cannot be written) DiskFull if it is refused. `recovered`: an
        async call that a previous control-plane process accepted, so it skips the queue
        and workspace limits, and its record is in the store already."""
        runtime = self.state.runtime_of(inp)
        if runtime is None:
            raise UnknownEndpoint(f"no endpoint named {inp.label}")
        max_queue = runtime.settings.max_queue or self.config.max_queue
        if not recovered and len(runtime.pending) >= max_queue:
            kind = call_kind(inp.streaming, inp.is_async)
            self.metrics.request_turned_away(runtime.app, runtime.spec.name, 429, kind)
            raise QueueFull(f"{inp.label} has {len(runtime.pending)} inputs queued; retry later")
        if not recovered:  # one a previous process accepted was admitted then
            self._admit(runtime, inp)
        if inp.is_async and recovered:
            self.journal.persist(inp, CallStatus.QUEUED)
        elif inp.is_async:
            self.journal.accept(inp)
        self.state.inputs[inp.id] = inp
        hold_body(self.state.bodies, inp)
        if inp.timeout is not None:
            inp.deadline_timer = inp.loop.call_later(inp.timeout, self._deadline_passed, inp)
        if inp.parent_id in self.state.inputs and not inp.is_async:
            # A call made for a live input: it ends when that input does (see `finish`).
            # A spawned call is the code's to keep.
            self.state.children.setdefault(inp.parent_id, set()).add(inp)
        self.queues.enqueue(runtime, inp)
        self.queues.dispatch(runtime)
        if runtime.pending:
            self.state.wake.set()

    def _admit(self, runtime: EndpointRuntime, inp: Input) -> None:
        """WorkspaceLimitReached when the workspace of the input's app is at one of its
        admission limits (`limits/admission.py`)."""
        workspace = split_app_key(runtime.app)[0]
        limits = self.limits.of(workspace)
        queued = running = 0
        if load_needed(limits, len(self.state.inputs)):
            queued, running = self.state.load_of(workspace)
        refusal = self.admission.admit(workspace, limits, queued, running, time.monotonic())
        if refusal is not None:
            kind = call_kind(inp.streaming, inp.is_async)
            self.metrics.request_turned_away(runtime.app, runtime.spec.name, 429, kind)
            self.metrics.workspace_refused(workspace, refusal.limit)
            raise WorkspaceLimitReached(refusal.message, refusal.limit, refusal.retry_after)

    def finish(self, inp: Input, outcome: Outcome) -> None:
        if inp.done:
            return
        inp.done = True
        inp.disarm()
        if inp.deadline_timer is not None:
            inp.deadline_timer.cancel()
        self.state.inputs.pop(inp.id, None)
        if inp.parent_id is not None:
            siblings = self.state.children.get(inp.parent_id)
            if siblings is not None:
                siblings.discard(inp)
                if not siblings:
                    del self.state.children[inp.parent_id]
        self._end_children(inp, f"the call that made it, {inp.id}, has ended")
        if inp.streaming and not inp.is_async:
            inp.add_event(*((END, None) if outcome.status == 200 else (ERROR, outcome.body)))
        if not inp.outcome.done():
            inp.outcome.set_result(outcome)
        if inp.is_async:
            self.journal.ended(inp, outcome)
            self.state.release_held(inp)  # its result is in its record now

    def fail_queued(self, runtime: EndpointRuntime, outcome: Outcome) -> None:
        """End every input queued for the runtime with `outcome`."""
        while runtime.pending:
            self.finish(runtime.pending.popleft(), outcome)

    def _end_children(self, inp: Input, reason: str) -> None:
        """Cancel the synchronous calls `inp`'s code made: nobody waits for their answers
        any more (the caller was that code)."""
        for child in self.state.children.pop(inp.id, ()):
            self.cancel(child, reason)

    def cancel(self, inp: Input, reason: str) -> None:
        """The caller went away: drop the input, and stop it on its replica."""
        self.stop(inp, Outcome.error(499, "cancelled", reason))

    def _deadline_passed(self, inp: Input) -> None:
        """The call's own time limit is up, wherever it is: queued, running, or queued
        again after a lost replica."""
        replica = self.state.replicas.get(inp.replica_id or "")
        runtime = self.state.runtime_of(inp)
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
        self.stop(inp, Outcome.error(504, "deadline_exceeded", message))

    def stop(self, inp: Input, outcome: Outcome) -> None:
        """End the input with `outcome`: off its queue, or stopped on its replica."""
        if inp.done:
            return
        runtime = self.state.runtime_of(inp)
        if runtime is not None and inp in runtime.pending:
            runtime.pending.remove(inp)
        replica = self.state.replicas.get(inp.replica_id or "")
        self.finish(inp, outcome)
        if replica is not None and inp.id in replica.inflight:
            # The slot stays taken until the replica says the work stopped; if it never
            # does within the input's timeout, the replica is replaced.
            replica.send(wire.Cancel(id=inp.id))
            for member in replica.gang.echoed() if replica.gang is not None else ():
                member.send(wire.Cancel(id=inp.id))  # its copy, likewise
            timeout = replica.endpoint.settings.timeout
            inp.arm(InputPhase.CANCELLING, timeout, self._cancel_overdue, inp, replica)

    def _cancel_overdue(self, inp: Input, replica: Replica) -> None:
        if replica.inflight.pop(inp.id, None) is not None:
            self._replace_sparing_neighbours(
                replica, f"input {inp.id} did not stop after it was cancelled"
            )

    def _replace_sparing_neighbours(self, replica: Replica, reason: str) -> None:
        """Replace a replica for one input's sake (taken off it already): the inputs
        beside it are retried without charge (not their fault)."""
        for other in replica.inflight.values():
            other.attempts -= 1
        self.replica_lost(replica, reason)

    def _on_timeout(self, inp: Input, seconds: float) -> None:
        replica = self.state.replicas.get(inp.replica_id or "")
        outcome = Outcome.error(
            504, "timeout", f"{inp.label} ran longer than its timeout of {seconds:g} s"
        )
        method = replica.endpoint.spec.methods.get(inp.method) if replica is not None else None
        if method is not None and method.is_async:
            # A coroutine can be cancelled where it waits: only it stops, and the inputs
            # beside it (a web app's other requests) run on.
            self.stop(inp, outcome)
            return
        self.finish(inp, outcome)
        if replica is not None:
            replica.inflight.pop(inp.id, None)
            # A sync function cannot be interrupted inside its thread: replace the replica.
            self._replace_sparing_neighbours(
                replica, f"input {inp.id} timed out; the replica is replaced"
            )

    def startup_failed(self, runtime: EndpointRuntime, message: str) -> None:
        """A replica of `runtime` failed to start; after too many in a row, what waits
        for one fails with the reason rather than wait for ever."""
        if self.replicas.startup_failed(runtime, message):
            message = (
                f"replicas of {runtime.label} fail to start: {message} "
                f"(see `ember logs {runtime.app}`)"
            )
            self.fail_queued(runtime, Outcome.error(500, "replica_start_failed", message))

    def replica_lost(
        self, replica: Replica, reason: str, *, startup_failure: bool = True, crashed: bool = False
    ) -> None:
        """The replica is gone or must go: kill it and requeue (or fail) its inputs. When
        it `crashed` (its process ended, unasked) with several inputs in flight, any one of
        them may have done it: none is charged the attempt, and each runs again alone, so
        that one which crashes replicas fails by its own retries, not its neighbours'."""
        if replica.id not in self.state.replicas:
            return
        if replica.state is ReplicaState.STARTING and startup_failure:
            self.startup_failed(replica.endpoint, reason)
        inflight = self.replicas.remove(replica, reason)
        if crashed and len(inflight) > 1:
            for inp in inflight:
                if not inp.suspect:
                    inp.suspect = True
                    inp.attempts -= 1  # counted once it runs alone
        # Requeued at the front one by one: reversed, so they keep their order.
        for inp in reversed(inflight):
            self._retry_or_fail(inp, f"replica {replica.id} was lost ({reason})")
        self.state.wake.set()

    def _retry_or_fail(self, inp: Input, reason: str) -> None:
        if inp.done:
            return
        inp.disarm()
        inp.replica_id = None
        runtime = self.state.runtime_of(inp)
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
            if inp.is_async:
                self.journal.persist(inp, CallStatus.QUEUED)
            self.logs.system(runtime.app, runtime.spec.name, f"input {inp.id} requeued: {reason}")
            self._to_front(runtime, inp)

    def retry_after_error(self, inp: Input, status: int, error_type: str, message: str) -> bool:
        """With `retries=Retries(...)`, an input whose code raised runs again after its
        backoff, until its retries are spent. Returns whether it will."""
        runtime = self.state.runtime_of(inp)
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
            self.journal.persist(inp, CallStatus.QUEUED)
        self.logs.system(
            runtime.app,
            runtime.spec.name,
            f"input {inp.id} raised {error_type}: {message[:200]}; retrying in {delay:g} s "
            f"(retry {inp.attempts} of {runtime.settings.retries})",
        )
        # A cancel meanwhile finishes the input, which disarms this timer.
        inp.arm(InputPhase.BACKING_OFF, delay, self._requeue, inp)
        return True

    def _requeue(self, inp: Input) -> None:
        if inp.done:
            return
        runtime = self.state.runtime_of(inp)
        if runtime is None:
            self.finish(inp, Outcome.error(404, "not_found", f"{inp.label} was stopped"))
            return
        inp.disarm()  # its backoff is over
        self._to_front(runtime, inp)

    def _to_front(self, runtime: EndpointRuntime, inp: Input) -> None:
        """An input to run again: at the front of its queue, dispatched if it can be."""
        self.queues.enqueue(runtime, inp, front=True)
        self.queues.dispatch(runtime)
        self.state.wake.set()

    def recover_calls(self) -> int:
        """Requeue the async calls a previous control-plane process left unfinished (a
        batch's requests are its runner's to take up)."""
        count = 0
        for record in self.journal.unfinished():
            if is_batch_call(record.id):
                continue
            runtime = self.state.endpoints.get(record.label)
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
