"""`ember.Retries`: retry inputs whose code raised, after a growing delay, as well as
inputs whose replica was lost (which a plain `retries=N` alone covers)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ember.errors import InvalidError

MAX_RETRIES = 10
LONGEST_DELAY_S = 3600.0


@dataclass(frozen=True)
class Retries:
    """Up to `max_retries` more attempts; the first retry waits `initial_delay` seconds,
    each later one `backoff_coefficient` times longer, never more than `max_delay`."""

    max_retries: int
    initial_delay: float = 1.0
    backoff_coefficient: float = 2.0
    max_delay: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            raise InvalidError(f"Retries(max_retries={self.max_retries!r}) takes a whole number")
        if not 0 <= self.max_retries <= MAX_RETRIES:
            raise InvalidError(f"Retries(max_retries={self.max_retries}): use 0 to {MAX_RETRIES}")
        for name, low, high in (
            ("initial_delay", 0.0, LONGEST_DELAY_S),
            ("backoff_coefficient", 1.0, 10.0),
            ("max_delay", 0.0, LONGEST_DELAY_S),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
                raise InvalidError(f"Retries({name}={value!r}) takes a number")
            if not low <= value <= high:
                raise InvalidError(
                    f"Retries({name}={value:g}) is out of range; use {low:g} to {high:g}"
                )

    def backoff(self) -> dict[str, float]:
        """The delays, as endpoint settings keep them (the count is `retries`)."""
        return {
            "initial_delay": float(self.initial_delay),
            "backoff_coefficient": float(self.backoff_coefficient),
            "max_delay": float(self.max_delay),
        }


def retry_delay(backoff: dict[str, Any], attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (1 for the first)."""
    delay = backoff["initial_delay"] * backoff["backoff_coefficient"] ** max(0, attempt - 1)
    return float(min(delay, backoff["max_delay"]))
