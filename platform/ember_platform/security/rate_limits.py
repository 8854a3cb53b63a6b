"""Per-token rate limits on calls: `ember token create --rate-limit 600/min`.

A token bucket per token, held by each control-plane process: it holds up to the limit's
count and refills at count per period, so a client may burst up to the count and then
goes at the rate. A call that finds the bucket empty gets 429 with the seconds until it
would not. The clock is passed in, so the arithmetic is tested without waiting."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PERIODS = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "hour": 3600.0}
_LIMIT = re.compile(r"\s*([0-9]+)\s*/\s*([a-z]+)\s*\Z", re.ASCII)  # ASCII digits only
MAX_COUNT = 1_000_000


@dataclass(frozen=True)
class RateLimit:
    count: int  # calls ...
    period: float  # ... per this many seconds

    @property
    def per_second(self) -> float:
        return self.count / self.period

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "min", 3600.0: "h"}[self.period]
        return f"{self.count}/{unit}"


def parse_rate_limit(text: str) -> RateLimit:
    """ "10/s", "600/min" or "10000/h"; ValueError saying what is expected otherwise."""
    found = _LIMIT.match(text.lower())
    period = PERIODS.get(found.group(2)) if found else None
    if found is None or period is None or not 1 <= int(found.group(1)) <= MAX_COUNT:
        raise ValueError(
            f"{text!r} is not a rate limit: write calls per second, minute or hour, such as "
            f"10/s, 600/min or 10000/h (1 to {MAX_COUNT} calls)"
        )
    return RateLimit(int(found.group(1)), period)


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}

    def wait_needed(self, key: str, limit: RateLimit, now: float) -> float:
        """0 when a call under `key` may go now (and it is counted); else the seconds
        until one may."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(limit.count), now)
        elapsed = max(0.0, now - bucket.updated)
        bucket.tokens = min(float(limit.count), bucket.tokens + elapsed * limit.per_second)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / limit.per_second

    def forget(self, key: str) -> None:
        self._buckets.pop(key, None)


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds: round up, so a retry then is let through."""
    return str(max(1, math.ceil(seconds)))
