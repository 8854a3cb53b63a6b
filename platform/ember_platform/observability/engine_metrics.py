"""The engines' own metrics (`engine_metrics=` on an endpoint: vLLM's `vllm:*`, ...), as
each replica scrapes them and sends them on its channel, exported after the platform's in
`/metrics` under their own names, with app, endpoint and replica labels; and the values
the autoscaler reads for `scale_on=`.

Only a replica's latest scrape is kept, and only while it is fresh (`STALE_SECONDS`) and
the replica lives. A replica runs its user's code: what it sends is checked again here,
and cheaply. A scrape that comes sooner than `MIN_INTERVAL` after the replica's last one
is dropped before its body is read, and so is a body over `MAX_WIRE_BYTES`. A family
whose name is not a Prometheus name, starts with `ember:` (the platform's), is of a kind
the text format cannot carry, or has samples that are not its own is left out, and so is
a family whose exported names another engine's family of another kind took (one family
per name in a scrape, which Prometheus would refuse whole). An engine's label that is
one of the platform's (app, endpoint, replica, workspace) is kept as `exported_<label>`,
as Prometheus names such labels.

The text is rendered here rather than through prometheus_client's registry, which took
45 µs a sample (1.5 s for 50 replicas of vLLM, on the event loop): each replica's
families once per scrape, and only when `/metrics` is read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ember.declarations import engine_metrics as limits
from ember.wire import messages as wire
from ember_platform.observability.metrics import with_workspaces

STALE_SECONDS = 5 * limits.SCRAPE_SECONDS  # a scrape older than this is not exported or used
MIN_INTERVAL = limits.SCRAPE_SECONDS / 2  # a replica's scrapes closer than this are dropped
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
# A family's HELP and TYPE lines: the name's suffix and the type, as prometheus_client
# writes them in the text format.
HEADER = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "unknown": ("", "untyped")}


@dataclass
class _Scrape:
    app: str
    endpoint: str
    at: float
    families: list[wire.EngineFamily]
    sums: dict[str, float] = field(default_factory=dict)  # sample name -> sum over labels
    text: dict[str, bytes] | None = None  # family -> its samples' lines, once rendered


def exported_names(family: wire.EngineFamily) -> frozenset[str]:
    """The names a family takes in the text format: its HELP/TYPE line's and its samples'."""
    header = family.name + HEADER.get(family.type, ("", ""))[0]
    return frozenset({header, *(family.name + s for s in SUFFIXES[family.type])})


_good_labels: set[str] = set()  # label names checked once (every scrape repeats them)


def _labels_ok(labels: dict[str, str]) -> bool:
    if not _good_labels.issuperset(labels):  # the common case in C: all seen before
        for name in labels:
            if not limits.LABEL_NAME.match(name) or name.startswith("__"):
                return False
            if len(_good_labels) < 10_000:
                _good_labels.add(name)
    if PLATFORM_LABELS.isdisjoint(labels):
        return True
    # Its `app` would become `exported_app`: not if it has that label too.
    return not any(k in labels and f"exported_{k}" in labels for k in PLATFORM_LABELS)


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
        if not _labels_ok(sample.labels):
            return None
        key = (sample.name, frozenset(sample.labels.items()))
        if key not in series:  # a series twice in one scrape: the first counts
            series.add(key)
            samples.append(sample)
    return wire.EngineFamily(name, family.type, samples, family.help) if samples else None


def _escaped(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class EngineMetrics:
    """Every live replica's latest scrape of its engine, for /metrics and the autoscaler."""

    def __init__(
        self, alive: Callable[[str], bool], clock: Callable[[], float] = time.time
    ) -> None:
        self._alive = alive  # whether a replica still lives (gone ones are forgotten)
        self.clock = clock  # the time source (tests set one)
        self._scrapes: dict[str, _Scrape] = {}  # replica -> its latest scrape
        self._last: dict[str, float] = {}  # replica -> when its last scrape came

    def report(
        self, replica: str, app: str, endpoint: str, message: wire.EngineMetrics, body: str
    ) -> None:
        """A replica's scrape; one that failed (`error`) leaves it with none. Raises
        WireError for a body that does not fit (too large, not families)."""
        now = self.clock()
        if replica not in self._last:  # a new replica: forget those gone meanwhile
            for other in [r for r in self._last if not self._alive(r)]:
                self.forget_replica(other)
        elif now - self._last[replica] < MIN_INTERVAL:
            return  # sooner than any replica of Ember's sends them: not read
        self._last[replica] = now
        if message.error is not None:
            self._scrapes.pop(replica, None)
            return
        families: dict[str, wire.EngineFamily] = {}
        budget = limits.MAX_SERIES
        for family in wire.engine_families(body):
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
        self._scrapes[replica] = _Scrape(app, endpoint, now, [*families.values()], sums)

    def value(self, replica: str, name: str) -> float | None:
        """The sum of a replica's samples named `name` (over their labels), from its latest
        scrape; None if that is stale or has no such sample."""
        scrape = self._fresh(replica)
        return None if scrape is None else scrape.sums.get(name)

    def forget_replica(self, replica: str) -> None:
        self._scrapes.pop(replica, None)
        self._last.pop(replica, None)

    def _fresh(self, replica: str) -> _Scrape | None:
        scrape = self._scrapes.get(replica)
        if scrape is None:
            return None
        if not self._alive(replica):
            self.forget_replica(replica)
            return None
        return scrape if self.clock() - scrape.at <= STALE_SECONDS else None

    def exposition(self) -> bytes:
        """Prometheus text of every fresh scrape: each family once, with the samples of
        every replica that has it."""
        families: dict[str, tuple[wire.EngineFamily, list[bytes]]] = {}
        taken: set[str] = set()  # the exported names of the families so far
        for replica in list(self._scrapes):
            scrape = self._fresh(replica)
            if scrape is None:
                continue
            if scrape.text is None:
                scrape.text = _rendered(replica, scrape)
            for family in scrape.families:
                known = families.get(family.name)
                if known is None:
                    names = exported_names(family)
                    if names & taken:
                        continue  # another family's names
                    taken |= names
                    known = families[family.name] = (family, [])
                elif known[0].type != family.type:
                    continue  # another engine's family of that name is of another kind
                known[1].append(scrape.text[family.name])
        return b"".join(_lines(family, chunks) for family, chunks in families.values())


def _lines(family: wire.EngineFamily, chunks: list[bytes]) -> bytes:
    suffix, kind = HEADER.get(family.type, ("", family.type))
    name = family.name + suffix
    text = family.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {text}\n# TYPE {name} {kind}\n".encode() + b"".join(chunks)


def _rendered(replica: str, scrape: _Scrape) -> dict[str, bytes]:
    """Each family's sample lines of one replica, its labels added (and a workspace's)."""
    own = f'app="{_escaped(scrape.app)}",endpoint="{_escaped(scrape.endpoint)}",'
    own += f'replica="{_escaped(replica)}"'
    rendered = {}
    for family in scrape.families:
        lines = []
        for sample in family.samples:
            labels = [own]
            for key, value in sample.labels.items():
                key = f"exported_{key}" if key in PLATFORM_LABELS else key
                labels.append(f'{key}="{_escaped(value)}"')
            lines.append(f"{sample.name}{{{','.join(labels)}}} {sample.value!r}\n")
        rendered[family.name] = with_workspaces("".join(lines).encode())
    return rendered
