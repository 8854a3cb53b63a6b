"""Service-level objectives (`ttft=500ms,itl=50ms,e2e=2s`) and whether a request met them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ember.errors import InvalidError
from ember.loadgen.records import RequestRecord

METRICS = ("ttft", "itl", "tpot", "e2e")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)\s*$")


def parse_duration(text: str) -> float:
    """'500ms' or '2s' or '0.5s' in seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidError(f"{text!r} is not a duration; write e.g. 500ms or 2s")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


@dataclass(frozen=True)
class Slos:
    """Upper bounds in seconds; None means no objective for that metric.

    `itl` bounds a request's longest gap between two events (a stutter is what users
    notice), `tpot` its average time per output token after the first.
    """

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in METRICS)

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in METRICS if getattr(self, name) is not None}

    def met_by(self, record: RequestRecord) -> bool:
        """A failed request meets no objective; a missing measurement (one token) meets it."""
        if not record.ok:
            return False
        itls = record.itls
        measured = {
            "ttft": record.ttft,
            "itl": max(itls) if itls else None,
            "tpot": record.tpot,
            "e2e": record.e2e,
        }
        for name in METRICS:
            bound, value = getattr(self, name), measured[name]
            if bound is not None and value is not None and value > bound:
                return False
        return True


def parse_slos(text: str) -> Slos:
    """Parse `ttft=500ms,itl=50ms,e2e=2s`; each metric at most once."""
    bounds: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or not name or not value.strip():
            raise InvalidError(
                f"{item.strip()!r} is not an SLO; write METRIC=DURATION, e.g. ttft=500ms"
            )
        if name not in METRICS:
            raise InvalidError(f"unknown SLO metric {name!r}; use {', '.join(METRICS)}")
        if name in bounds:
            raise InvalidError(f"the SLO for {name} is given twice")
        seconds = parse_duration(value)
        if seconds <= 0:
            raise InvalidError(f"the SLO for {name} must be positive")
        bounds[name] = seconds
    return Slos(**bounds)
