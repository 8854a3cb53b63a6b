"""Percentiles and the mean/P50/P95/P99 summaries the report shows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (NumPy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """A latency distribution in seconds."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary | None:
    """None when there is nothing to summarize (e.g. no request produced two tokens)."""
    if not values:
        return None
    return Summary(
        count=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p95=percentile(values, 95),
        p99=percentile(values, 99),
    )
