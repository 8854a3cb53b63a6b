"""The last hour of each endpoint's metrics, in memory, for the dashboard's plots.

Every few seconds the sampler (`history_sampler.py`) hands over one `Reading` per
endpoint: the running totals `/metrics` keeps (requests, histogram buckets, starts) and
what holds now (queue, replicas by state, GPU power). Each endpoint keeps bounded rings of
what the plots show: rates over the last interval, quantiles over a short window, and the
gauges as they were. Nothing here is stored: a restart begins an empty hour.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

WINDOW_SECONDS = 3600.0  # what the plots cover
SAMPLE_SECONDS = 5.0  # how often a reading is taken
# Quantiles are of the requests that ended in the last half minute: one interval's few
# requests would make them jump.
QUANTILE_WINDOW_SECONDS = 30.0
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
LATENCIES = ("e2e", "ttft", "itl")  # the histograms whose quantiles are plotted
REPLICA_STATES = ("starting", "ready", "draining", "stopping")
START_KINDS = ("cold", "restore")  # always plotted; other kinds appear when seen

Buckets = Mapping[float, float]  # upper bound (le, math.inf last) -> cumulative count


class Ring:
    """A bounded sequence of numbers or None: appending to a full one drops its oldest.
    Kept as one array of doubles (None as NaN): 8 bytes a point, an hour of 25 series is
    some 150 KB an endpoint."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a ring holds at least one item, not {capacity}")
        self._values = array("d", [math.nan]) * capacity
        self._start = 0  # index of the oldest item
        self._length = 0

    def append(self, item: float | None) -> None:
        capacity = len(self._values)
        value = math.nan if item is None else float(item)
        if self._length < capacity:
            self._values[(self._start + self._length) % capacity] = value
            self._length += 1
        else:
            self._values[self._start] = value
            self._start = (self._start + 1) % capacity

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[float | None]:
        capacity = len(self._values)
        for offset in range(self._length):
            value = self._values[(self._start + offset) % capacity]
            yield None if math.isnan(value) else value

    def last(self, count: int) -> list[float | None]:
        """The newest `count` items, oldest first."""
        if count <= 0:
            return []
        return list(self)[-count:]


@dataclass
class Reading:
    """One endpoint at one instant: running totals (they only grow, but across a restart
    of their source) and gauges."""

    requests: float = 0.0  # requests that ended, any status
    errors: float = 0.0  # of those, the failed ones
    latencies: dict[str, Buckets] = field(default_factory=dict)  # LATENCIES' buckets
    starts: dict[str, float] = field(default_factory=dict)  # kind -> replicas started
    start_seconds: dict[str, float] = field(default_factory=dict)  # kind -> their total time
    queued: float = 0.0
    running: float = 0.0
    replicas: dict[str, int] = field(default_factory=dict)  # state -> replicas
    gpu_watts: float | None = None  # None: no GPU of its replicas reports power


def quantile(q: float, buckets: Buckets) -> float | None:
    """The `q` quantile of a histogram's cumulative `buckets`, interpolated inside the
    bucket it falls in (as Prometheus' histogram_quantile does); None when it is empty."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower  # past the last finite bound: that bound is all one can say
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def increase(now: float, before: float | None) -> float:
    """What a running total gained; a smaller one restarted from zero."""
    if before is None:
        return 0.0
    return now - before if now >= before else now


def bucket_increase(now: Buckets, before: Buckets | None) -> dict[float, float]:
    if before is None or any(now.get(b, 0.0) < c for b, c in before.items()):
        return dict(now)  # first seen, or reset
    return {b: c - before.get(b, 0.0) for b, c in now.items()}


class EndpointHistory:
    """One endpoint's rings: a time ring and one ring per series, all of one length (a
    series first seen late is filled with None before)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times = Ring(capacity)
        self.series: dict[str, Ring] = {}
        self._previous: tuple[float, Reading] | None = None
        # Readings of the quantile window, for bucket increases over it.
        self._recent: deque[tuple[float, Reading]] = deque()

    def add(self, at: float, reading: Reading) -> None:
        values = self._values(at, reading)
        self.times.append(at)
        for name in values:
            if name not in self.series:
                ring = self.series[name] = Ring(self.capacity)
                for _ in range(len(self.times) - 1):
                    ring.append(None)
        for name, ring in self.series.items():
            ring.append(values.get(name))
        self._previous = (at, reading)
        self._recent.append((at, reading))
        while at - self._recent[0][0] > QUANTILE_WINDOW_SECONDS:
            self._recent.popleft()

    def _values(self, at: float, reading: Reading) -> dict[str, float | None]:
        values: dict[str, float | None] = {}
        before = None if self._previous is None else self._previous[1]
        elapsed = None if self._previous is None else at - self._previous[0]
        if before is None or not elapsed or elapsed <= 0:
            values["requests_per_s"] = values["errors_per_s"] = None
        else:
            values["requests_per_s"] = increase(reading.requests, before.requests) / elapsed
            values["errors_per_s"] = increase(reading.errors, before.errors) / elapsed
        oldest = self._recent[0][1] if self._recent else None
        for name in LATENCIES:
            now = reading.latencies.get(name, {})
            then = None if oldest is None else oldest.latencies.get(name)
            window = bucket_increase(now, then)
            for suffix, q in QUANTILES.items():
                values[f"{name}_{suffix}"] = quantile(q, window)
        values["queued"] = reading.queued
        values["running"] = reading.running
        for state in sorted({*REPLICA_STATES, *reading.replicas}):
            values[f"replicas_{state}"] = float(reading.replicas.get(state, 0))
        # Starts are counted from zero at an endpoint's first reading: its totals began
        # with this process, as this history did (a rate needs two readings; a count not).
        counted = before or Reading()
        for kind in sorted({*START_KINDS, *reading.starts}):
            started = increase(reading.starts.get(kind, 0.0), _get(counted, "starts", kind))
            took = increase(
                reading.start_seconds.get(kind, 0.0), _get(counted, "start_seconds", kind)
            )
            values[f"starts_{kind}"] = started
            # The mean start of this interval's starts; None: none started.
            values[f"start_{kind}_seconds"] = took / started if started > 0 else None
        values["gpu_watts"] = reading.gpu_watts
        return values

    def since(self, after: float) -> dict[str, object]:
        """The points taken after `after` (a Unix time), as JSON-ready columns."""
        times = [t for t in self.times if t is not None]
        keep = sum(1 for t in times if t > after)
        return {
            "t": [round(t, 3) for t in times[len(times) - keep :]],
            "series": {name: _rounded(ring.last(keep)) for name, ring in self.series.items()},
        }

    @property
    def newest(self) -> float | None:
        last = self.times.last(1)
        return last[0] if last else None  # never None itself: times are never missing


def _get(reading: Reading | None, name: str, kind: str) -> float | None:
    if reading is None:
        return None
    totals: dict[str, float] = getattr(reading, name)
    return totals.get(kind, 0.0)


def _rounded(values: Iterable[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 6) for v in values]


class MetricsHistory:
    """Every endpoint's history over the last `window` seconds, one point per reading."""

    def __init__(self, window: float = WINDOW_SECONDS, interval: float = SAMPLE_SECONDS) -> None:
        self.window = window
        self.interval = interval
        self.capacity = max(1, math.ceil(window / interval))
        self._endpoints: dict[str, EndpointHistory] = {}

    def record(self, at: float, readings: Mapping[str, Reading]) -> None:
        """One reading of every live endpoint (by label), taken at `at`. An endpoint not
        read for a whole window (stopped) is forgotten."""
        for label, reading in readings.items():
            history = self._endpoints.get(label)
            if history is None:
                history = self._endpoints[label] = EndpointHistory(self.capacity)
            history.add(at, reading)
        for label in [
            label
            for label, history in self._endpoints.items()
            if (history.newest or 0.0) < at - self.window
        ]:
            del self._endpoints[label]

    def labels(self) -> list[str]:
        return sorted(self._endpoints)

    def of(self, label: str, after: float = 0.0) -> dict[str, object] | None:
        """An endpoint's points newer than `after`; None if it has none kept."""
        history = self._endpoints.get(label)
        return None if history is None else history.since(after)
