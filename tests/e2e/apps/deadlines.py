"""Endpoints that take as long as they are told to, for the tests of calls' own limits."""

import asyncio

import ember


@ember.endpoint(snapshot=False, max_replicas=1, concurrency=1)
async def wait(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@ember.endpoint(snapshot=False, max_replicas=1, concurrency=1)
async def ticks(n: int, every: float):
    for i in range(n):
        await asyncio.sleep(every)
        yield i
