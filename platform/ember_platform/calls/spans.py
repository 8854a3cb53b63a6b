"""Spans to an OpenTelemetry collector: each request the gateway answered, and each
spawned call that ended, over OTLP/HTTP with JSON bodies (`ember server --otlp-endpoint`).

A request's span has the trace and span ids its log line and `X-Ember-Trace-Id` have,
its caller's span as parent, the time from arrival to the last byte, and events for the
moment a replica took it and, for streams, the first event. Spans are sent in batches
from a background task; while the collector is unreachable they are held (the oldest
dropped past a bound) and sent when it answers again, so serving never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ember.calling.tracing import TraceContext
from ember.wire.labels import split_label
from ember_platform.calls.webhooks import receivers_context
from ember_platform.observability.request_stats import RequestStats
from ember_platform.runtime.inputs import Input

log = logging.getLogger("ember.spans")

TRACES_PATH = "/v1/traces"
SERVER_KIND = 2  # SPAN_KIND_SERVER
STATUS_UNSET, STATUS_ERROR = 0, 2
FLUSH_SECONDS = 1.0
MAX_BATCH = 512
MAX_HELD = 10_000
SEND_TIMEOUT_S = 10.0
# OTLP/HTTP's rule: only these answers mean "try again"; any other failure status means
# the collector will never take the batch (bad data, a refused token), so it is dropped.
RETRYABLE_STATUSES = (429, 502, 503, 504)
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
HEADERS_ENV = "OTEL_EXPORTER_OTLP_HEADERS"


def traces_url(endpoint: str) -> str:
    """OTLP's rule: a base URL gets /v1/traces; one that names it already is kept."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def parse_headers(text: str) -> dict[str, str]:
    """`key=value,key2=value2`, as OTEL_EXPORTER_OTLP_HEADERS writes them."""
    headers = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, equals, value = part.partition("=")
        if not equals or not key.strip():
            raise ValueError(f"{part.strip()!r} is not KEY=VALUE")
        headers[key.strip()] = value.strip()
    return headers


def _attribute(key: str, value: str | int | float | bool) -> dict[str, Any]:
    if isinstance(value, bool):
        typed: dict[str, Any] = {"boolValue": value}
    elif isinstance(value, str):
        typed = {"stringValue": value}
    elif isinstance(value, int):
        typed = {"intValue": str(value)}  # 64-bit integers are strings in OTLP's JSON
    else:
        typed = {"doubleValue": value}
    return {"key": key, "value": typed}


def _nanos(unix_seconds: float) -> str:
    return str(int(unix_seconds * 1e9))


def _sampled(trace: TraceContext | None) -> bool:
    return trace is not None and bool(int(trace.flags, 16) & 1)


def _span(
    trace: TraceContext,
    label: str,
    method: str,
    times: tuple[float, float],
    status: int,
    attributes: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> dict[str, Any]:
    span: dict[str, Any] = {
        "traceId": trace.trace_id,
        "spanId": trace.span_id,
        "name": f"{label} {method}",
        "kind": SERVER_KIND,
        "startTimeUnixNano": _nanos(times[0]),
        "endTimeUnixNano": _nanos(times[1]),
        "attributes": [*attributes, _attribute("http.response.status_code", status)],
        "events": events,
        # 5xx is the platform's or the code's failure; a 4xx is the caller's (OTel's rule
        # for server spans).
        "status": {"code": STATUS_ERROR if status >= 500 else STATUS_UNSET},
    }
    if trace.parent_span is not None:
        span["parentSpanId"] = trace.parent_span
    return span


def request_span(stats: RequestStats, now: float | None = None) -> dict[str, Any] | None:
    """The OTLP span of a finished request; None for one without a sampled trace."""
    trace = stats.trace
    if trace is None or not _sampled(trace):
        return None
    ended_unix = time.time() if now is None else now
    ended = stats.ended if stats.ended is not None else time.monotonic()
    started_unix = ended_unix - (ended - stats.arrived)

    def at(monotonic: float) -> str:
        return _nanos(started_unix + (monotonic - stats.arrived))

    attributes = [
        _attribute("ember.app", stats.app),
        _attribute("ember.endpoint", stats.endpoint),
        _attribute("ember.method", stats.method),
        _attribute("ember.request_id", stats.request_id),
    ]
    if stats.replica is not None:
        attributes.append(_attribute("ember.replica", stats.replica))
    if stats.version is not None:
        attributes.append(_attribute("ember.version", stats.version))
    if stats.affinity is not None:
        attributes.append(_attribute("ember.affinity_key", stats.affinity))
    events = []
    if stats.queue_seconds is not None:
        events.append(
            {"timeUnixNano": at(stats.arrived + stats.queue_seconds), "name": "dispatched"}
        )
    if stats.streaming:
        attributes.append(_attribute("ember.events", stats.events))
        if stats.first_event is not None:
            events.append({"timeUnixNano": at(stats.first_event), "name": "first_event"})
    label = f"{stats.app}--{stats.endpoint}"
    times = (started_unix, ended_unix)
    return _span(trace, label, stats.method, times, stats.status or 0, attributes, events)


def call_span(inp: Input, status: int, now: float | None = None) -> dict[str, Any] | None:
    """The OTLP span of a spawned call that ended: from its acceptance to its end."""
    if inp.trace is None or not _sampled(inp.trace):
        return None
    app, endpoint = split_label(inp.label) or (inp.label, "")
    attributes = [
        _attribute("ember.app", app),
        _attribute("ember.endpoint", endpoint),
        _attribute("ember.method", inp.method),
        _attribute("ember.call_id", inp.id),
        _attribute("ember.spawned", True),
        _attribute("ember.attempts", inp.attempts),
    ]
    if inp.replica_id is not None:
        attributes.append(_attribute("ember.replica", inp.replica_id))
    events = []
    if inp.dispatched_at is not None:  # the last attempt's
        events.append({"timeUnixNano": _nanos(inp.dispatched_at), "name": "dispatched"})
    times = (inp.created_at, time.time() if now is None else now)
    return _span(inp.trace, inp.label, inp.method, times, status, attributes, events)


def export_body(spans: list[dict[str, Any]]) -> dict[str, Any]:
    resource = {"attributes": [_attribute("service.name", "ember")]}
    scope = {"name": "ember.gateway"}
    return {
        "resourceSpans": [{"resource": resource, "scopeSpans": [{"scope": scope, "spans": spans}]}]
    }


class SpanExporter:
    def __init__(
        self,
        endpoint: str,
        headers: dict[str, str] | None = None,
        *,
        ca_cert: Path | None = None,
        flush_seconds: float = FLUSH_SECONDS,
        send_timeout: float = SEND_TIMEOUT_S,
    ) -> None:
        self.url = traces_url(endpoint)
        self.headers = headers or {}
        self.ca_cert = ca_cert
        self.flush_seconds = flush_seconds
        self.send_timeout = send_timeout
        self.held: deque[dict[str, Any]] = deque(maxlen=MAX_HELD)
        self.dropped = 0  # spans the bound pushed out while the collector was away
        self._full = asyncio.Event()
        self._failing = False
        self._warned: set[str] = set()  # problems said since the last batch that got through
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    def record(self, stats: RequestStats) -> None:
        self._hold(request_span(stats))

    def record_call(self, inp: Input, status: int) -> None:
        self._hold(call_span(inp, status))

    def _hold(self, span: dict[str, Any] | None) -> None:
        if span is None:
            return
        if len(self.held) == self.held.maxlen:
            self.dropped += 1
        self.held.append(span)
        if len(self.held) >= MAX_BATCH:
            self._full.set()

    def start(self) -> None:
        verify = receivers_context(self.ca_cert, "--otlp-ca-cert")  # the system's CAs too
        self._client = httpx.AsyncClient(timeout=self.send_timeout, verify=verify)
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Send what is held (briefly: a collector that is away does not hold up a stop)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), 2.0)
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.flush_seconds)
            self._full.clear()
            await self.flush()

    async def flush(self) -> None:
        while self.held and self._client is not None:
            batch = [self.held.popleft() for _ in range(min(MAX_BATCH, len(self.held)))]
            retry = False
            try:
                response = await self._client.post(
                    self.url, json=export_body(batch), headers=self.headers
                )
            except httpx.ReadTimeout:
                # Sent whole, no answer in time: the collector may well have it, and
                # sending it again would make every span a duplicate while it stays slow.
                self._warn_once(
                    "slow",
                    f"the collector at {self.url} did not answer within {self.send_timeout:g} s; "
                    "spans sent to it meanwhile are not sent again",
                )
                continue
            except httpx.HTTPError as exc:  # not sent, or not whole: it has none of it
                failure, retry = str(exc) or type(exc).__name__, True
            else:
                if response.is_success:
                    self._reached()
                    continue
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
                retry = response.status_code in RETRYABLE_STATUSES
            if not retry:
                self._warn_once(
                    f"refused {response.status_code}",
                    f"the collector at {self.url} refused {len(batch)} spans ({failure}); "
                    "they are dropped, since sending them again would be refused too",
                )
                continue
            if not self._failing:  # once per outage, not per batch
                log.warning(
                    "spans not sent to %s (%s); holding up to %d and retrying",
                    self.url,
                    failure,
                    MAX_HELD,
                )
            self._failing = True
            # Back in front, as far as the spans that came meanwhile leave room.
            kept = batch[max(0, len(batch) - (MAX_HELD - len(self.held))) :]
            self.dropped += len(batch) - len(kept)
            self.held.extendleft(reversed(kept))
            return

    def _reached(self) -> None:
        if self._failing:
            log.warning("spans reach %s again (%d dropped meanwhile)", self.url, self.dropped)
            self._failing, self.dropped = False, 0
        self._warned.clear()  # a later problem is said again

    def _warn_once(self, kind: str, text: str) -> None:
        """Said once until the collector takes a batch again."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", text)


def settings_problem(endpoint: str | None) -> str | None:
    """Why the collector settings (the option, else OTel's variables) cannot be used, or
    None: checked at start, so a typo is told at once rather than as failed sends."""
    option = "--otlp-endpoint" if endpoint else f"${ENDPOINT_ENV}"
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    parts = urlsplit(endpoint)
    try:
        parts.port  # noqa: B018 (it raises for a port that is not a number)
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (
            f"{option} {endpoint!r} is not an http(s) URL of a collector, e.g. "
            "http://127.0.0.1:4318"
        )
    try:
        parse_headers(os.environ.get(HEADERS_ENV, ""))
    except ValueError as exc:
        return f"${HEADERS_ENV}: {exc}; write KEY=VALUE,KEY2=VALUE2"
    return None


def exporter_from(
    endpoint: str | None, headers: dict[str, str], ca_cert: Path | None
) -> SpanExporter | None:
    """The exporter the options (else OTel's standard variables) ask for, if any."""
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    merged = {**parse_headers(os.environ.get(HEADERS_ENV, "")), **headers}
    return SpanExporter(endpoint, merged, ca_cert=ca_cert)
