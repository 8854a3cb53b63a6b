"""The endpoints' own metrics (`ember.Counter`, `ember.Gauge`, `ember.Histogram`), as
their replicas' heartbeats report them, exported with the platform's.

Counters and histograms are kept per endpoint: each heartbeat adds what a replica's
running totals grew by, so they survive the replicas that counted them. A gauge is kept
per replica, and goes with it. What is malformed is skipped, and so is a series whose
name another app already uses for another kind or other buckets (one family per name), or
whose exported names another family's samples take (`hits` counts as `hits_total`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

from prometheus_client.core import Metric

from ember.user_metrics import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    LABEL_PATTERN,
    MAX_BUCKETS,
    MAX_SERIES,
    NAME_PATTERN,
)

PREFIX = "ember:user_"
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, the user's


def _number(value: Any) -> TypeGuard[int | float]:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class Series:
    name: str
    kind: str
    help: str
    labels: Labels
    # A counter's running total; a histogram's cumulative counts per bucket (the last
    # for +Inf, so the count) and then its sum; a gauge's value.
    totals: tuple[float, ...]
    buckets: tuple[float, ...] = ()


def parse_series(row: Any) -> Series | None:
    """One reported series, or None if it is malformed."""
    if not isinstance(row, dict):
        return None
    name, kind, labels = row.get("name"), row.get("kind"), row.get("labels")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        return None
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and LABEL_PATTERN.match(k) and isinstance(v, str)
        for k, v in labels.items()
    ):
        return None
    text = str(row.get("help", ""))[:200]
    pairs = tuple(sorted(labels.items()))
    if kind in (COUNTER, GAUGE):
        value = row.get("value")
        return Series(name, kind, text, pairs, (float(value),)) if _number(value) else None
    if kind != HISTOGRAM:
        return None
    buckets, counts, total = row.get("buckets"), row.get("counts"), row.get("sum")
    if not isinstance(buckets, list) or not isinstance(counts, list) or not _number(total):
        return None
    if not 0 < len(buckets) <= MAX_BUCKETS or len(counts) != len(buckets) + 1:
        return None
    if not all(_number(b) for b in buckets) or not all(_number(c) for c in counts):
        return None
    totals = (*(float(c) for c in counts), float(total))
    return Series(name, kind, text, pairs, totals, tuple(float(b) for b in buckets))


def exported_names(name: str, kind: str) -> frozenset[str]:
    """The names a family takes in the exposition: its own and its samples'. Two
    families may share none (a counter `hits` is `hits_total`, so a gauge `hits_total`
    would make a second family of that name, which a scrape refuses whole)."""
    if kind == COUNTER:
        return frozenset({name, f"{name}_total"})
    if kind == HISTOGRAM:
        return frozenset({name, f"{name}_bucket", f"{name}_count", f"{name}_sum"})
    return frozenset({name})


def _growth(now: tuple[float, ...], before: tuple[float, ...] | None) -> tuple[float, ...]:
    """What running totals grew by since `before`. The count (the first total of a
    counter, the last bucket of a histogram) only grows; a smaller one is a new count
    (a restarted process), all of which is new."""
    if before is None or len(before) != len(now):
        return now
    count_index = 0 if len(now) == 1 else len(now) - 2
    if now[count_index] < before[count_index]:
        return now
    return tuple(a - b for a, b in zip(now, before, strict=True))


class UserMetrics:
    def __init__(self) -> None:
        # name -> (kind, description, buckets): the first report's, which the rest must match
        self._families: dict[str, tuple[str, str, tuple[float, ...]]] = {}
        self._taken: set[str] = set()  # the exported names of those families
        # (name, app, endpoint, labels) -> the endpoint's totals
        self._totals: dict[tuple[str, str, str, Labels], tuple[float, ...]] = {}
        # replica -> (name, labels) -> its last running totals
        self._seen: dict[str, dict[tuple[str, Labels], tuple[float, ...]]] = {}
        # replica -> (name, labels) -> (app, endpoint, value)
        self._gauges: dict[str, dict[tuple[str, Labels], tuple[str, str, float]]] = {}

    def report(self, replica: str, app: str, endpoint: str, rows: list[Any]) -> None:
        """A replica's heartbeat: every series its code holds."""
        seen = self._seen.setdefault(replica, {})
        gauges: dict[tuple[str, Labels], tuple[str, str, float]] = {}
        for row in rows[:MAX_SERIES]:
            series = parse_series(row)
            if series is None:
                continue
            family = self._families.get(series.name)
            if family is None:
                names = exported_names(series.name, series.kind)
                if names & self._taken:
                    continue  # its samples' names are another family's
                family = self._families[series.name] = (series.kind, series.help, series.buckets)
                self._taken |= names
            if family != (series.kind, family[1], series.buckets):
                continue  # another app's metric of that name is of another shape
            key = (series.name, series.labels)
            if series.kind == GAUGE:
                gauges[key] = (app, endpoint, series.totals[0])
                continue
            grown = _growth(series.totals, seen.get(key))
            seen[key] = series.totals
            total_key = (series.name, app, endpoint, series.labels)
            before = self._totals.get(total_key) or (0.0,) * len(grown)
            self._totals[total_key] = tuple(a + b for a, b in zip(before, grown, strict=True))
        self._gauges[replica] = gauges

    def forget_replica(self, replica: str) -> None:
        self._seen.pop(replica, None)
        self._gauges.pop(replica, None)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def family(name: str) -> Metric:
            if name not in families:
                kind, text, _ = self._families[name]
                families[name] = Metric(PREFIX + name, text, kind)
            return families[name]

        for (name, app, endpoint, labels), totals in self._totals.items():
            metric = family(name)
            base = {"app": app, "endpoint": endpoint, **dict(labels)}
            kind, _, buckets = self._families[name]
            if kind == COUNTER:
                metric.add_sample(f"{PREFIX}{name}_total", base, totals[0])
                continue
            for bound, count in zip((*buckets, math.inf), totals[:-1], strict=True):
                le = "+Inf" if bound == math.inf else repr(bound)
                metric.add_sample(f"{PREFIX}{name}_bucket", {**base, "le": le}, count)
            metric.add_sample(f"{PREFIX}{name}_count", base, totals[-2])
            metric.add_sample(f"{PREFIX}{name}_sum", base, totals[-1])
        for replica, gauges in self._gauges.items():
            for (name, labels), (app, endpoint, value) in gauges.items():
                sample = {"app": app, "endpoint": endpoint, "replica": replica, **dict(labels)}
                family(name).add_sample(PREFIX + name, sample, value)
        yield from families.values()
