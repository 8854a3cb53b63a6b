"""What is kept and told of each call. An async call: its record in the state store at
each step (accepted, queued, running, ended), and at its end its span and its webhook. A
synchronous request, once answered: its metrics, its line in the app's log, its span, and
its outcome in the comparison of a canary with the serving version.

Synchronous calls keep no record. A new async call whose record cannot be written is
refused (`DiskFull`); a later state the store refuses is held in memory until it takes
writes again (`CallRecords`).
"""

from __future__ import annotations

import time

from ember.wire.labels import split_label
from ember_platform.calls.records import CallRecords
from ember_platform.calls.spans import SpanExporter
from ember_platform.calls.webhooks import WebhookSender
from ember_platform.errors import DiskFull, StoreUnavailable
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.request_stats import RequestStats
from ember_platform.observability.token_usage import BATCH, ONLINE, TokenLedger, answer_tokens
from ember_platform.runtime.inputs import Input, Outcome, is_batch_call
from ember_platform.runtime.live_state import LiveState
from ember_platform.storage.records import WEBHOOK_PENDING, CallRecord, CallStatus
from ember_platform.storage.state_store import (
    StateStore,
    StoreUnavailableError,
    StoreWriteError,
)


class CallJournal:
    def __init__(
        self,
        state: LiveState,
        calls: CallRecords,
        store: StateStore,
        logs: LogSink,
        metrics: PlatformMetrics,
        webhooks: WebhookSender | None,  # None: no webhooks are sent
        spans: SpanExporter | None,  # calls' spans to a collector, if one is set
    ) -> None:
        self.state = state
        self.calls = calls
        self.store = store
        self.logs = logs
        self.metrics = metrics
        self.webhooks = webhooks
        self.spans = spans
        self.tokens = TokenLedger()  # written to the store at each controller tick

    def accept(self, inp: Input) -> None:
        """A new async call's first record; DiskFull, or StoreUnavailable, (and the call is
        refused) when the store cannot take it: nothing is promised that could not survive
        a restart."""
        try:
            self.calls.accept(call_record(inp, CallStatus.QUEUED))
        except StoreUnavailableError as error:
            raise StoreUnavailable(
                f"the call was not accepted, as the control plane could not record it "
                f"({error}); retry once the state database answers"
            ) from None
        except StoreWriteError as error:
            raise DiskFull(
                f"the call was not accepted, as the control plane could not record it "
                f"({error}); retry once its state dir's disk has room"
            ) from None

    def persist(self, inp: Input, status: CallStatus, outcome: Outcome | None = None) -> CallRecord:
        record = call_record(inp, status, outcome)
        self.calls.put(record)
        return record

    def ended(self, inp: Input, outcome: Outcome) -> None:
        """The async call ended: its span, its last record, and its webhook if it has one."""
        status = CallStatus.SUCCEEDED if outcome.status == 200 else CallStatus.FAILED
        self._count(inp, outcome.status)
        tokens = answer_tokens(outcome.body) if outcome.status == 200 else None
        named = split_label(inp.label)
        if tokens is not None and named is not None:
            self._count_tokens(*named, BATCH if is_batch_call(inp.id) else ONLINE, tokens)
        if self.spans is not None:
            self.spans.record_call(inp, outcome.status)
        record = self.persist(inp, status, outcome)
        if record.webhook is not None and self.webhooks is not None:
            self.webhooks.deliver(record)

    def _count(self, inp: Input, status: int) -> None:
        """A spawned call's end in the request metrics. Its times are wall-clock ones:
        a call accepted before a restart of the control plane is timed from then."""
        named = split_label(inp.label)
        if named is None:
            return
        now = time.time()
        queued = None if inp.dispatched_at is None else inp.dispatched_at - inp.created_at
        self.metrics.call_finished(*named, status, now - inp.created_at, queued)

    def request_finished(self, stats: RequestStats, inp: Input, status: int) -> None:
        """A synchronous request ended with `status`: its latencies into the metrics, its
        line into the app's log (written at the next tick)."""
        queued = None if inp.dispatched_at is None else inp.dispatched_at - inp.created_at
        stats.finish(status, inp.replica_id, queued)
        self.state.release_held(inp)  # answered (or its caller left)
        self.metrics.request_finished(stats)
        if stats.tokens is not None and status == 200:
            self._count_tokens(stats.app, stats.endpoint, ONLINE, stats.tokens)
        if inp.canary or inp.label in self.state.canaries:  # a canary's two sides, compared
            runtime = self.state.runtime_of(inp)
            if runtime is not None:
                runtime.outcomes.note(status, stats.e2e_seconds)
            self.metrics.version_request_finished(stats, "canary" if inp.canary else "serving")
        self.logs.buffer(stats.app, stats.log_entry())
        if self.spans is not None:
            self.spans.record(stats)

    def _count_tokens(self, app: str, endpoint: str, traffic: str, tokens: tuple[int, int]) -> None:
        self.tokens.add(app, endpoint, traffic, tokens, time.time())
        self.metrics.usage.tokens_used(app, endpoint, traffic, tokens)

    def unfinished(self) -> list[CallRecord]:
        """The calls a previous control-plane process accepted and did not finish."""
        return self.store.unfinished_calls()

    def resume_webhooks(self) -> int:
        """Send again the webhooks a previous control-plane process left undelivered."""
        if self.webhooks is None:
            return 0
        pending = self.store.pending_webhooks()
        for record in pending:
            self.webhooks.deliver(record)
        return len(pending)


def call_record(inp: Input, status: CallStatus, outcome: Outcome | None = None) -> CallRecord:
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
        result=bytes(outcome.body) if outcome else None,
        media_type=outcome.media_type if outcome else None,
        filename=outcome.filename if outcome else None,
        webhook=inp.webhook,
        webhook_state=WEBHOOK_PENDING if outcome and inp.webhook else None,
    )
