"""What the caller of one request saw: its timings, event gaps and token ids.

The gateway fills one `RequestStats` per synchronous request: when it arrived, when a
replica took it, when each streamed event left, how it ended. From it come the latency
metrics (named like vLLM's) and the request's log line. Token ids are picked up where a
request's arguments or a stream's events carry them, so tokenizer and chat-template bugs
can be found from the logs alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ember.calling.tracing import TraceContext
from ember_platform.observability.token_usage import answer_tokens

# Argument names that hold a prompt's token ids; event fields that hold generated ones.
PROMPT_ID_KEYS = ("prompt_ids", "prompt_token_ids", "input_ids")
EVENT_ID_KEYS = ("token_id", "token_ids")
PROMPT_IDS_ANSWERED = "prompt_token_ids"  # the prompt's ids, said by the endpoint's answer
MAX_LOGGED_IDS = 4096  # a log line stays a line


@dataclass
class RequestStats:
    request_id: str
    app: str
    endpoint: str
    method: str
    streaming: bool
    arrived: float = field(default_factory=time.monotonic)
    queue_seconds: float | None = None  # arrival to dispatch to a replica
    first_event: float | None = None
    last_event: float | None = None
    events: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive events
    ended: float | None = None
    status: int | None = None
    replica: str | None = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    parent_id: str | None = None  # the input whose code made this call
    affinity: str | None = None  # its affinity key, to see why it ran where it did
    version: int | None = None  # of the app: the canary's, or the serving one's
    trace: TraceContext | None = None  # its W3C trace context
    tokens: tuple[int, int] | None = None  # (input, output) its answer's `usage` says

    def note_arguments(self, body: bytes) -> None:
        """Keep the prompt's token ids if the arguments name them (JSON object body)."""
        if not any(key.encode() in body for key in PROMPT_ID_KEYS):
            return  # most requests carry none: skip the parse
        try:
            arguments = json.loads(body)
        except ValueError:
            return
        if isinstance(arguments, dict):
            for key in PROMPT_ID_KEYS:
                ids = _token_ids(arguments.get(key))
                if ids is not None:
                    self.prompt_ids = ids
                    return

    def note_event(self, data: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first_event is None:
            self.first_event = now
        elif self.last_event is not None:
            self.gaps.append(now - self.last_event)
        self.last_event = now
        self.events += 1
        if data[:1] == b"{" and any(key.encode() in data for key in EVENT_ID_KEYS):
            self._note_ids(data)
        if data[:1] == b"{" and b'"usage"' in data:  # a stream's last chunk may say
            self.tokens = answer_tokens(data) or self.tokens

    def note_result(self, body: bytes | bytearray) -> None:
        """A whole answer (not streamed) may carry token ids too, as OpenAI-style answers
        with `prompt_token_ids` and `token_ids` do."""
        if body[:1] == b"{" and any(key.encode() in body for key in EVENT_ID_KEYS):
            self._note_ids(body)
        self.tokens = answer_tokens(body)

    def finish(self, status: int, replica: str | None, queue_seconds: float | None) -> None:
        self.ended = time.monotonic()
        self.status = status
        self.replica = replica
        self.queue_seconds = queue_seconds

    @property
    def e2e_seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.arrived

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.first_event is None else self.first_event - self.arrived

    @property
    def tpot_seconds(self) -> float | None:
        """Time per output event after the first: the decode speed a caller sees."""
        if self.first_event is None or self.last_event is None or self.events < 2:
            return None
        return (self.last_event - self.first_event) / (self.events - 1)

    def log_entry(self) -> dict[str, Any]:
        """The request's line in its app's log (`ember logs`)."""
        entry: dict[str, Any] = {
            "ts": time.time(),
            "app": self.app,
            "endpoint": self.endpoint,
            "replica": self.replica,
            "stream": "request",
            "request_id": self.request_id,
            "method": self.method,
            "status": self.status,
            "e2e_s": round(self.e2e_seconds, 6),
            "queue_s": None if self.queue_seconds is None else round(self.queue_seconds, 6),
        }
        text = (
            f"{self.method} {self.status} in {self.e2e_seconds * 1000:.1f} ms"
            f" (queue {(self.queue_seconds or 0.0) * 1000:.1f} ms"
        )
        if self.streaming:
            ttft, tpot = self.ttft_seconds, self.tpot_seconds
            entry.update(
                events=self.events,
                ttft_s=None if ttft is None else round(ttft, 6),
                tpot_s=None if tpot is None else round(tpot, 6),
            )
            if ttft is not None:
                text += f", first event {ttft * 1000:.1f} ms, {self.events} events"
        if self.parent_id is not None:
            entry["parent_id"] = self.parent_id
            text += f", called by {self.parent_id}"
        if self.affinity is not None:
            entry["affinity"] = self.affinity
        if self.version is not None:
            entry["version"] = self.version
        if self.trace is not None:
            entry["trace_id"] = self.trace.trace_id
            entry["span_id"] = self.trace.span_id
            if self.trace.parent_span is not None:
                entry["parent_span_id"] = self.trace.parent_span
        if self.prompt_ids is not None:
            entry["prompt_ids"] = self.prompt_ids[:MAX_LOGGED_IDS]
        if self.output_ids is not None:
            entry["output_ids"] = self.output_ids[:MAX_LOGGED_IDS]
        entry["text"] = text + ")"
        return entry

    def _note_ids(self, data: bytes | bytearray) -> None:
        """Generated ids from an event or answer; the prompt's too if the arguments had
        none (an endpoint that tokenizes itself may say which ids it used)."""
        try:
            event = json.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if self.prompt_ids is None:
            self.prompt_ids = _token_ids(event.get(PROMPT_IDS_ANSWERED))
        for key in EVENT_ID_KEYS:
            value = event.get(key)
            ids = [value] if isinstance(value, int) and not isinstance(value, bool) else None
            ids = ids or _token_ids(value)
            if ids is not None:
                self.output_ids = (self.output_ids or []) + ids
                return


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        return list(value)
    return None
