"""W3C Trace Context: a call's `traceparent`, so that Ember's calls join the caller's
traces (OpenTelemetry and any tracer that speaks the standard).

The gateway continues the trace of a call that brings a valid `traceparent`, or starts a
new one, and gives the call a span id of its own. The trace id is in the call's log line
and in the `X-Ember-Trace-Id` response header. In a replica, calls the code makes carry
its `traceparent` (their parent span: the input's), and `ember.current_trace_id()` is
the trace the input belongs to, for the code's own logs and spans."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ember.cancellation import current_input_flag

TRACEPARENT_HEADER = "traceparent"
TRACE_ID_HEADER = "X-Ember-Trace-Id"
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})\Z")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
TRACE_ID_BYTES = 24  # the random bytes of a new trace id and span id


@dataclass(frozen=True)
class TraceContext:
    trace_id: str  # 32 hex digits
    span_id: str  # this call's own span: 16 hex digits
    parent_span: str | None  # the caller's span, when it sent one
    flags: str = "01"  # sampled, unless the caller said otherwise

    @property
    def traceparent(self) -> str:
        """The header a call made within this one carries (this span as its parent)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def continue_trace(traceparent: str | None, fresh: bytes | None = None) -> TraceContext:
    """A new span in the caller's trace, or in a new trace when the header is absent or
    not valid (as the standard says: a receiver restarts the trace). `fresh`: the
    TRACE_ID_BYTES random bytes the new ids are made of (default: the kernel's, now)."""
    ids = (fresh or os.urandom(TRACE_ID_BYTES)).hex()
    found = _TRACEPARENT.match(traceparent.strip().lower()) if traceparent else None
    if found is None or found[1] == _ZERO_TRACE or found[2] == _ZERO_SPAN:
        return TraceContext(ids[:32], ids[32:], None)
    return TraceContext(found[1], ids[32:], found[2], found[3])


def current_traceparent() -> str | None:
    """In a replica: the `traceparent` of the input the code runs for; None outside one."""
    return getattr(current_input_flag(), "trace", None)


def current_trace_id() -> str | None:
    """In a replica: the id of the trace the input the code runs for belongs to."""
    traceparent = current_traceparent()
    return None if traceparent is None else traceparent.split("-")[1]
