"""`amap_calls`: order, the cap on calls in flight, errors in their places, and leaving
early, over a fake call (the platform's side runs in the e2e tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from ember.calling.async_mapping import amap_calls
from ember.errors import InvalidError, RemoteError


def _collect(**options: Any) -> list[tuple[int, Any]]:
    async def scenario() -> list[tuple[int, Any]]:
        return [pair async for pair in amap_calls(**options)]

    return asyncio.run(scenario())


def test_results_come_in_input_order_or_as_they_finish_within_the_cap() -> None:
    in_flight, most = 0, 0

    async def call(arguments: Mapping[str, Any]) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(arguments["delay"])
        in_flight -= 1
        return arguments["n"]

    inputs = [{"n": n, "delay": 0.05 if n == 0 else 0.001} for n in range(10)]
    ordered = _collect(
        call=call, inputs=inputs, concurrency=3, order_outputs=True, return_exceptions=False
    )
    assert ordered == [(n, n) for n in range(10)] and most == 3
    unordered = _collect(
        call=call, inputs=inputs, concurrency=3, order_outputs=False, return_exceptions=False
    )
    assert sorted(unordered) == ordered and unordered[-1] == (0, 0)  # the slow one last


def test_a_failure_raises_naming_its_input_unless_kept_in_its_place() -> None:
    async def call(arguments: Mapping[str, Any]) -> Any:
        if arguments["n"] == 1:
            raise RemoteError(500, "ValueError", "one")
        return arguments["n"]

    inputs = [{"n": n} for n in range(3)]
    kept = _collect(
        call=call, inputs=inputs, concurrency=2, order_outputs=True, return_exceptions=True
    )
    assert kept[0] == (0, 0) and kept[2] == (2, 2) and isinstance(kept[1][1], RemoteError)
    with pytest.raises(RemoteError, match="one") as caught:
        _collect(
            call=call, inputs=inputs, concurrency=2, order_outputs=True, return_exceptions=False
        )
    assert "(input 1 of the map)" in caught.value.__notes__
    with pytest.raises(InvalidError, match="not a dict of keyword arguments"):
        _collect(
            call=call,
            inputs=[{"n": 0}, 5],
            concurrency=1,
            order_outputs=True,
            return_exceptions=False,
        )
    with pytest.raises(InvalidError, match="at least 1"):
        _collect(call=call, inputs=[], concurrency=0, order_outputs=True, return_exceptions=False)


def test_leaving_early_cancels_the_calls_in_flight_and_reads_no_more_inputs() -> None:
    cancelled: list[int] = []
    taken: list[int] = []

    async def call(arguments: Mapping[str, Any]) -> Any:
        if arguments["n"] == 0:
            return 0
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(arguments["n"])
            raise
        return arguments["n"]

    async def inputs():
        for n in range(1000):
            taken.append(n)
            yield {"n": n}

    async def scenario() -> Any:
        results = amap_calls(
            call, inputs(), concurrency=2, order_outputs=False, return_exceptions=False
        )
        first = await anext(results)
        await results.aclose()
        return first

    assert asyncio.run(scenario()) == (0, 0)
    assert cancelled and len(taken) <= 2 * 16  # a bounded backlog, not the whole input
