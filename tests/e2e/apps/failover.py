"""Endpoints for the failover test: a short call, and a schedule that records its runs."""

import time

import ember

ticks = ember.Dict("ticks")  # the replica's app, once used there


@ember.endpoint(retries=3, scaledown_window=30.0)
def work(x: int, seconds: float = 0.2) -> dict:
    time.sleep(seconds)
    return {"x": x}


@ember.endpoint(scaledown_window=30.0)
def count(n: int):
    for i in range(n):
        time.sleep(0.1)
        yield i


@ember.endpoint(schedule=ember.Period(seconds=1), scaledown_window=30.0)
def tick() -> dict:
    ran_at = time.time()
    ticks["last"] = ran_at
    return {"ran_at": ran_at}
