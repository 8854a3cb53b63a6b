"""An endpoint with two replicas, for placement over zones and nodes."""

import time

import ember


@ember.endpoint(min_replicas=2, max_replicas=2, concurrency=2, snapshot=False)
def served(seconds: float = 0.0) -> float:
    time.sleep(seconds)
    return seconds
