"""When requests are sent: Poisson arrivals for paced workloads."""

from __future__ import annotations

import random
from collections.abc import Iterator


def poisson_gaps(rate: float, seed: int | None = None) -> Iterator[float]:
    """Endless gaps (seconds) between arrivals of a Poisson process of `rate` per second.

    The gaps are exponentially distributed with mean 1/rate; a seed makes runs repeatable.
    """
    if rate <= 0:
        raise ValueError(f"the rate must be positive, not {rate}")
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(rate)
