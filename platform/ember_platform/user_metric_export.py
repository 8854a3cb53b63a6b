"""The endpoints' own metrics (`ember.Counter`, `ember.Gauge`), as their replicas' heartbeats
report them, exported with the platform's.

A counter is kept per endpoint: each heartbeat adds what a replica's running total grew
by, so it survives the replicas that counted it. A gauge is kept per replica, and goes
with it. Replicas send what their code defined; what is malformed is skipped, and so is
a series whose name another app already uses for the other kind (one family per name).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from ember.user_metrics import COUNTER, GAUGE, LABEL_PATTERN, MAX_SERIES, NAME_PATTERN

PREFIX = "ember:user_"
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, the user's


def _parsed(row: Any) -> tuple[str, str, str, Labels, float] | None:
    """(name, kind, help, labels, value) of one reported series, or None if malformed."""
    if not isinstance(row, dict):
        return None
    name, kind, value, labels = (
        row.get("name"),
        row.get("kind"),
        row.get("value"),
        row.get("labels"),
    )
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or kind not in (COUNTER, GAUGE):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and LABEL_PATTERN.match(k) and isinstance(v, str)
        for k, v in labels.items()
    ):
        return None
    return name, kind, str(row.get("help", ""))[:200], tuple(sorted(labels.items())), float(value)


class UserMetrics:
    def __init__(self) -> None:
        self._kinds: dict[str, tuple[str, str]] = {}  # name -> (kind, description), the first
        # (name, app, endpoint, labels) -> the endpoint's total
        self._counters: dict[tuple[str, str, str, Labels], float] = {}
        # replica -> (name, labels) -> its last running total
        self._seen: dict[str, dict[tuple[str, Labels], float]] = {}
        # replica -> (name, labels) -> (app, endpoint, value)
        self._gauges: dict[str, dict[tuple[str, Labels], tuple[str, str, float]]] = {}

    def report(self, replica: str, app: str, endpoint: str, rows: list[Any]) -> None:
        """A replica's heartbeat: every series its code holds, with running totals."""
        seen = self._seen.setdefault(replica, {})
        gauges: dict[tuple[str, Labels], tuple[str, str, float]] = {}
        for row in rows[:MAX_SERIES]:
            parsed = _parsed(row)
            if parsed is None:
                continue
            name, kind, text, labels, value = parsed
            if self._kinds.setdefault(name, (kind, text))[0] != kind:
                continue
            if kind == GAUGE:
                gauges[(name, labels)] = (app, endpoint, value)
                continue
            before = seen.get((name, labels), 0.0)
            seen[(name, labels)] = value
            # Totals only grow; a smaller one is a new count (a restarted process).
            grown = value - before if value >= before else value
            if grown > 0:
                key = (name, app, endpoint, labels)
                self._counters[key] = self._counters.get(key, 0.0) + grown
        self._gauges[replica] = gauges

    def forget_replica(self, replica: str) -> None:
        self._seen.pop(replica, None)
        self._gauges.pop(replica, None)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def family(name: str) -> Metric:
            if name not in families:
                kind, text = self._kinds[name]
                families[name] = Metric(PREFIX + name, text, kind)
            return families[name]

        for (name, app, endpoint, labels), total in self._counters.items():
            sample = {"app": app, "endpoint": endpoint, **dict(labels)}
            family(name).add_sample(f"{PREFIX}{name}_total", sample, total)
        for replica, gauges in self._gauges.items():
            for (name, labels), (app, endpoint, value) in gauges.items():
                sample = {"app": app, "endpoint": endpoint, "replica": replica, **dict(labels)}
                family(name).add_sample(PREFIX + name, sample, value)
        yield from families.values()
