"""Scheduled endpoints for the end-to-end tests: one quick, one slower than its period."""

import time

import ember


@ember.endpoint(schedule=ember.Period(seconds=2), scaledown_window=30.0)
def tick(label: str = "scheduled") -> dict:
    print(f"tick ran: {label}")
    return {"label": label, "ran_at": time.time()}


@ember.endpoint(
    schedule=ember.Period(seconds=1), concurrency=1, max_replicas=1, scaledown_window=30.0
)
def slow() -> dict:
    time.sleep(2.5)
    return {"slept": 2.5}
