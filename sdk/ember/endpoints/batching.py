"""`@ember.batched`: gather concurrent inputs of one method into one call.

The decorated function takes a list per parameter and returns a list of results, one per
input, in order; callers still call it with single values. A replica collects up to
`max_batch_size` inputs, waiting at most `wait_ms` after the first one, then makes one
call: what a GPU (or a vectorised CPU kernel) wants from many small requests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ember.errors import InvalidError

F = TypeVar("F", bound=Callable[..., Any])

BATCHED_ATTR = "__ember_batched__"


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int
    wait_ms: float


def batched(*, max_batch_size: int, wait_ms: float) -> Callable[[F], F]:
    """Mark a function endpoint (under `@ember.endpoint`) or a method (with
    `@ember.method`) as batched: it is called with lists, at most `max_batch_size` long,
    after waiting up to `wait_ms` milliseconds for the batch to fill."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
        raise InvalidError(f"max_batch_size must be a whole number, not {max_batch_size!r}")
    if not 1 <= max_batch_size <= 10_000:
        raise InvalidError(f"max_batch_size={max_batch_size} is out of range; use 1 to 10000")
    if isinstance(wait_ms, bool) or not isinstance(wait_ms, int | float):
        raise InvalidError(f"wait_ms must be a number of milliseconds, not {wait_ms!r}")
    if not 0 <= wait_ms <= 60_000:
        raise InvalidError(f"wait_ms={wait_ms} is out of range; use 0 to 60000")

    def mark(func: F) -> F:
        if not inspect.isfunction(func):
            raise InvalidError(f"@ember.batched decorates a function, not {func!r}")
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise InvalidError(
                f"{func.__qualname__} is a generator; a batched function returns one list "
                "of results (streams cannot be batched)"
            )
        setattr(func, BATCHED_ATTR, BatchSettings(max_batch_size, float(wait_ms)))
        return func

    return mark


def batch_settings(func: Any) -> BatchSettings | None:
    found = getattr(func, BATCHED_ATTR, None)
    return found if isinstance(found, BatchSettings) else None
