"""`@ember.health_check`: a class endpoint's own test of whether a replica can still
serve (its GPU answers, its model is loaded, its connections work).

A replica runs it every `period` seconds once it is ready. A check that raises, or does
not return within `timeout`, fails; after `failures` failures in a row the replica is
replaced: it takes no new inputs, finishes those in flight, and stops, while the
platform starts another. Hardware fails at scale; this turns a replica that would
answer every input with an error (a GPU fallen off the bus, a poisoned CUDA context)
into one that goes away.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.errors import InvalidError

F = TypeVar("F", bound=Callable[..., Any])

HEALTH_ATTR = "__ember_health_check__"


@dataclass(frozen=True)
class HealthCheck:
    period: float  # seconds between the end of one check and the start of the next
    timeout: float  # seconds a check may take before it counts as failed
    failures: int  # failed checks in a row that make the replica unhealthy


def _seconds(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidError(f"@ember.health_check({name}=...) takes seconds, not {value!r}")
    if not low <= value <= high:
        raise InvalidError(
            f"@ember.health_check({name}={value}) is out of range; use {low:g} to {high:g}"
        )
    return float(value)


def health_check(
    func: F | None = None, *, period: float = 10.0, timeout: float = 10.0, failures: int = 3
) -> Any:
    """Mark the method of a class endpoint that says whether a replica is healthy: it
    raises (or hangs past `timeout`) when it is not. It takes no arguments but `self`,
    and runs beside the inputs, on a thread of its own (or the event loop, if async)."""
    if isinstance(failures, bool) or not isinstance(failures, int) or not 1 <= failures <= 100:
        raise InvalidError(
            f"@ember.health_check(failures=...) takes a whole number from 1 to 100, not "
            f"{failures!r}"
        )
    checked = HealthCheck(
        _seconds("period", period, 0.05, 3600.0),
        _seconds("timeout", timeout, 0.05, 3600.0),
        failures,
    )

    def mark(target: F) -> F:
        if not inspect.isfunction(target):
            raise InvalidError(f"@ember.health_check decorates a method, not {target!r}")
        if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
            raise InvalidError(f"{target.__qualname__}: a health check returns; it cannot yield")
        required = [
            p.name
            for p in list(inspect.signature(target).parameters.values())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            raise InvalidError(
                f"{target.__qualname__}: a health check is called with no arguments, but it "
                f"needs {required}"
            )
        setattr(target, HEALTH_ATTR, checked)
        return target

    return mark if func is None else mark(func)


def health_settings(func: Any) -> HealthCheck | None:
    found = getattr(func, HEALTH_ATTR, None)
    return found if isinstance(found, HealthCheck) else None
