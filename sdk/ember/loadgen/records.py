"""One request as the caller saw it: when it was sent, when each event came, how it ended."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any


def is_success(status: int) -> bool:
    """Any 2xx: a web app may answer 201."""
    return 200 <= status < 300


def tokens_in_event(data: str) -> int:
    """Output tokens one event stands for: its `token_ids`/`token_id` if it names any, else 1."""
    try:
        payload = json.loads(data)
    except ValueError:
        return 1
    if isinstance(payload, dict):
        ids = payload.get("token_ids")
        if isinstance(ids, list):
            return len(ids)
        if payload.get("token_id") is not None:
            return 1
    return 1


@dataclass
class RequestRecord:
    """Times are `time.perf_counter()` seconds; derived latencies are in seconds."""

    index: int
    sent_at: float
    event_times: list[float] = field(default_factory=list)  # when each event arrived
    output_tokens: int = 0
    finished_at: float | None = None
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None
    streamed: bool = False

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.status is not None
            and is_success(self.status)
            and self.finished_at is not None
        )

    @property
    def ttft(self) -> float | None:
        return self.event_times[0] - self.sent_at if self.event_times else None

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive events."""
        times = self.event_times
        return [later - earlier for earlier, later in pairwise(times)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if len(self.event_times) < 2 or self.output_tokens < 2:
            return None
        return (self.event_times[-1] - self.event_times[0]) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.sent_at

    def to_dict(self, origin: float) -> dict[str, Any]:
        """JSON-ready, with times relative to `origin` (the run's start)."""
        return {
            "index": self.index,
            "sent_at": self.sent_at - origin,
            "status": self.status,
            "ok": self.ok,
            "error": self.error,
            "streamed": self.streamed,
            "output_tokens": self.output_tokens,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "itls": self.itls,
        }
