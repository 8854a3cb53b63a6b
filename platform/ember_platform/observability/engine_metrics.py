"""The engines' own metrics (`engine_metrics=` on an endpoint: vLLM's `vllm:*`, ...), as
each replica scrapes them and sends them on its channel, exported with the platform's
under their own names, with app, endpoint and replica labels; and the values the
autoscaler reads for `scale_on=`.

Only a replica's latest scrape is kept, and only while it is fresh (`STALE_SECONDS`) and
the replica lives. A replica runs its user's code: what it sends is checked again here.
A family whose name is not a Prometheus name, starts with `ember:` (the platform's), is
of a kind the text format cannot carry, or has samples that are not its own is dropped,
and so is a family whose exported names another engine's family of another kind took
(one family per name in a scrape, which Prometheus would refuse whole). An engine's
label that is one of the platform's (app, endpoint, replica, workspace) is kept as
`exported_<label>`, as Prometheus names such labels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from ember.endpoints import engine_metrics as limits
from ember.wire import messages as wire

STALE_SECONDS = 5 * limits.SCRAPE_SECONDS  # a scrape older than this is not exported or used
PLATFORM_LABELS = frozenset({"app", "endpoint", "replica", "workspace"})
# The samples each kind of family may have, by suffix of the family's name.
SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", ""),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "info": ("_info",),
    "unknown": ("",),
}
# The name a family's HELP and TYPE lines take in the text format (prometheus_client's).
HEADER_SUFFIX = {"counter": "_total", "info": "_info"}


@dataclass
class _Scrape:
    app: str
    endpoint: str
    at: float
    families: list[wire.EngineFamily]
    sums: dict[str, float] = field(default_factory=dict)  # sample name -> sum over labels


def exported_names(family: wire.EngineFamily) -> frozenset[str]:
    """The names a family takes in the text format: its HELP/TYPE line's and its samples'."""
    header = family.name + HEADER_SUFFIX.get(family.type, "")
    return frozenset({header, *(family.name + s for s in SUFFIXES[family.type])})


def _checked(family: wire.EngineFamily, budget: int) -> wire.EngineFamily | None:
    """The family, its samples cut to `budget`, if it may be exported; else None."""
    name = family.name
    if (
        family.type not in SUFFIXES
        or not limits.METRIC_NAME.match(name)
        or name.startswith(limits.RESERVED_PREFIX)
    ):
        return None
    own = {name + suffix for suffix in SUFFIXES[family.type]}
    samples = []
    series: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for sample in family.samples[:budget]:
        if sample.name not in own or not math.isfinite(sample.value):
            return None
        if not all(limits.LABEL_NAME.match(k) and not k.startswith("__") for k in sample.labels):
            return None
        key = (sample.name, frozenset(sample.labels.items()))
        if key not in series:  # a series twice in one scrape: the first counts
            series.add(key)
            samples.append(sample)
    return wire.EngineFamily(name, family.type, samples, family.help) if samples else None


class EngineMetrics:
    """A collector for the platform's registry, fed by the replicas' channels."""

    def __init__(
        self, alive: Callable[[str], bool], clock: Callable[[], float] = time.time
    ) -> None:
        self._alive = alive  # whether a replica still lives (gone ones are forgotten)
        self.clock = clock  # the time source (tests set one)
        self._scrapes: dict[str, _Scrape] = {}  # replica -> its latest scrape

    def report(self, replica: str, app: str, endpoint: str, message: wire.EngineMetrics) -> None:
        """A replica's scrape; one that failed (`error`) leaves it with none."""
        if message.error is not None:
            self._scrapes.pop(replica, None)
            return
        families: dict[str, wire.EngineFamily] = {}
        budget = limits.MAX_SERIES
        for family in message.families:
            if budget <= 0:
                break
            checked = None if family.name in families else _checked(family, budget)
            if checked is not None:
                families[family.name] = checked
                budget -= len(checked.samples)
        sums: dict[str, float] = {}
        for family in families.values():
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        self._scrapes[replica] = _Scrape(app, endpoint, self.clock(), [*families.values()], sums)

    def value(self, replica: str, name: str) -> float | None:
        """The sum of a replica's samples named `name` (over their labels), from its latest
        scrape; None if that is stale or has no such sample."""
        scrape = self._fresh(replica)
        return None if scrape is None else scrape.sums.get(name)

    def forget_replica(self, replica: str) -> None:
        self._scrapes.pop(replica, None)

    def _fresh(self, replica: str) -> _Scrape | None:
        scrape = self._scrapes.get(replica)
        if scrape is None:
            return None
        if not self._alive(replica):
            del self._scrapes[replica]
            return None
        return scrape if self.clock() - scrape.at <= STALE_SECONDS else None

    def collect(self) -> Iterator[Metric]:
        exported: dict[str, Metric] = {}
        taken: set[str] = set()  # the exported names of the families so far
        for replica in list(self._scrapes):
            scrape = self._fresh(replica)
            if scrape is None:
                continue
            for family in scrape.families:
                metric = exported.get(family.name)
                if metric is None:
                    names = exported_names(family)
                    if names & taken:
                        continue  # another family's names
                    taken |= names
                    metric = exported[family.name] = Metric(family.name, family.help, family.type)
                elif metric.type != family.type:
                    continue  # another engine's family of that name is of another kind
                for sample in family.samples:
                    labels = {
                        (f"exported_{k}" if k in PLATFORM_LABELS else k): v
                        for k, v in sample.labels.items()
                    }
                    if len(labels) < len(sample.labels):
                        continue  # it had both `app` and `exported_app`
                    labels.update(app=scrape.app, endpoint=scrape.endpoint, replica=replica)
                    metric.add_sample(sample.name, labels, sample.value)
        yield from exported.values()
