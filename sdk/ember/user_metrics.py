"""Metrics of the endpoint's own code, exported with the platform's in `/metrics`:

    hits = ember.Counter("prefix_cache_hits", "Prompts whose prefix was cached", ["model"])
    hits.inc(model="smollm2")
    used = ember.Gauge("kv_cache_used_ratio", "Share of the KV cache in use")
    used.set(0.42)
    steps = ember.Histogram("decode_step_seconds", "One decode step", buckets=[0.01, 0.1])
    steps.observe(0.023)

A replica keeps its values in memory and sends them with its heartbeats (once a second).
The control plane exports a counter as `ember:user_NAME_total`, summed over the replicas
of each endpoint and kept as replicas come and go (a histogram likewise, as
`ember:user_NAME_bucket`, `_sum` and `_count`), and a gauge as `ember:user_NAME` with
each replica's own value while it lives, all labelled with app and endpoint. A metric
without labels is exported at 0 from its declaration on (one with labels, from its first
use with each set of values). Outside a replica they count, and go nowhere.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from ember.errors import InvalidError

NAME_PATTERN = re.compile(r"[a-z_][a-z0-9_]{0,63}\Z")
LABEL_PATTERN = re.compile(r"[a-z_][a-z0-9_]{0,31}\Z")
RESERVED_LABELS = frozenset({"app", "endpoint", "replica", "le", "quantile"})  # the platform's
MAX_LABELS = 5
MAX_LABEL_VALUE = 100
MAX_SERIES = 1000  # per replica, over all its metrics: a label must not be an id

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_BUCKETS = 30

_lock = threading.Lock()
# name -> (kind, description, label names, buckets); one definition per name in a process.
_definitions: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {}
# (name, label values) -> value; a histogram's: its count per bucket, then count and sum
_values: dict[tuple[str, tuple[str, ...]], Any] = {}
_dropped: set[str] = set()  # metrics whose new series were dropped at MAX_SERIES (said once)


class _Metric:
    kind = ""

    def __init__(
        self,
        name: str,
        description: str = "",
        labels: Sequence[str] = (),
        buckets: tuple[float, ...] = (),
    ) -> None:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise InvalidError(
                f"metric name {name!r}: use 1-64 lower-case letters, digits and underscores, "
                "not starting with a digit"
            )
        labels = tuple(labels)
        if len(labels) > MAX_LABELS or len(set(labels)) != len(labels):
            raise InvalidError(f"metric {name}: at most {MAX_LABELS} labels, each once")
        for label in labels:
            if not isinstance(label, str) or not LABEL_PATTERN.match(label):
                raise InvalidError(f"metric {name}: {label!r} is not a label name")
            if label in RESERVED_LABELS:
                raise InvalidError(f"metric {name}: the label {label!r} is the platform's")
        definition = (self.kind, str(description), labels, buckets)
        with _lock:
            known = _definitions.setdefault(name, definition)
        if known[0] != self.kind or known[2] != labels or known[3] != buckets:
            raise InvalidError(
                f"metric {name} is already a {known[0]} with labels {list(known[2])}"
                + (f" and buckets {list(known[3])}" if known[3] else "")
            )
        self.name = name
        self.labels = labels
        if not labels:
            # Exported from its declaration, at 0: a count nothing has raised yet reads
            # as 0, not as a series that is missing (a rate() or an alert then sees it).
            key = (name, ())
            with _lock:
                if key not in _values and self._room_for(key):
                    _values[key] = [0.0] * (len(buckets) + 3) if buckets else 0.0

    def _series(self, values: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        if set(values) != set(self.labels):
            raise InvalidError(
                f"metric {self.name} takes the labels {list(self.labels)}, got {sorted(values)}"
            )
        return self.name, tuple(str(values[label])[:MAX_LABEL_VALUE] for label in self.labels)

    def _add(self, amount: float, labels: dict[str, Any], *, replace: bool = False) -> None:
        key = self._series(labels)
        with _lock:
            if self._room_for(key):
                _values[key] = float(amount) if replace else _values.get(key, 0.0) + float(amount)

    def _room_for(self, key: tuple[str, tuple[str, ...]]) -> bool:
        """Whether the series exists or may be made (the lock is held)."""
        if key in _values or len(_values) < MAX_SERIES:
            return True
        if self.name not in _dropped:
            _dropped.add(self.name)
            print(
                f"ember: metric {self.name}: over {MAX_SERIES} series in this replica; new "
                "label values are dropped",
                flush=True,
            )
        return False

    def value(self, **labels: Any) -> float:
        """The value this process holds (its own share of a counter)."""
        with _lock:
            return _values.get(self._series(labels), 0.0)


class Counter(_Metric):
    """A count that only goes up (requests served, tokens made, cache hits)."""

    kind = COUNTER

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        if not isinstance(amount, int | float) or isinstance(amount, bool) or amount < 0:
            raise InvalidError(f"counter {self.name} goes up by a number >= 0, not {amount!r}")
        self._add(amount, labels)


class Gauge(_Metric):
    """A value that goes up and down (cache use, batch size, temperature)."""

    kind = GAUGE

    def set(self, value: float, **labels: Any) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise InvalidError(f"gauge {self.name} is set to a number, not {value!r}")
        self._add(value, labels, replace=True)

    def inc(self, amount: float = 1.0, **labels: Any) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1.0, **labels: Any) -> None:
        self._add(-amount, labels)


class Histogram(_Metric):
    """How values spread (step times, batch sizes, prompt lengths): counts per bucket of
    upper bounds, with the sum and count of what was observed."""

    kind = HISTOGRAM

    def __init__(
        self,
        name: str,
        description: str = "",
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or len(bounds) > MAX_BUCKETS or list(bounds) != sorted(set(bounds)):
            raise InvalidError(
                f"histogram {name}: 1 to {MAX_BUCKETS} bucket bounds, increasing, each once"
            )
        if not all(math.isfinite(b) for b in bounds):
            raise InvalidError(f"histogram {name}: bucket bounds are finite numbers")
        super().__init__(name, description, labels, bounds)
        self.buckets = bounds

    def observe(self, value: float, **labels: Any) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
            raise InvalidError(f"histogram {self.name} observes numbers, not {value!r}")
        key = self._series(labels)
        index = bisect.bisect_left(self.buckets, value)  # the first bound >= value
        with _lock:
            if not self._room_for(key):
                return
            counts = _values.setdefault(key, [0.0] * (len(self.buckets) + 3))
            counts[index] += 1  # index len(buckets): above every bound (+Inf)
            counts[-2] += 1
            counts[-1] += float(value)

    def value(self, **labels: Any) -> float:
        """How many values this process observed."""
        with _lock:
            counts = _values.get(self._series(labels))
        return counts[-2] if counts else 0.0


def snapshot() -> list[dict[str, Any]]:
    """Every series with its definition, as a heartbeat carries them (a histogram's
    `value` is its count, with cumulative `counts` per bucket and the `sum`)."""
    rows = []
    with _lock:
        for (name, values), value in _values.items():
            kind, text, label_names, buckets = _definitions[name]
            row: dict[str, Any] = {
                "name": name,
                "kind": kind,
                "help": text,
                "labels": dict(zip(label_names, values, strict=True)),
            }
            if kind == HISTOGRAM:
                row.update(
                    value=value[-2],
                    buckets=list(buckets),
                    counts=list(itertools.accumulate(value[: len(buckets) + 1])),
                    sum=value[-1],
                )
            else:
                row["value"] = value
            rows.append(row)
    return rows
