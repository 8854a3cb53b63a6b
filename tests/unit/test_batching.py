"""`@ember.batched`: the decorator's checks and the replica's batcher."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import ember
from ember.endpoints.batching import BatchSettings, batch_settings
from ember.errors import InvalidError
from ember_worker.replica.batching import Batcher, BatchResultError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0, "wait_ms": 5}, "out of range"),
        ({"max_batch_size": 2.5, "wait_ms": 5}, "whole number"),
        ({"max_batch_size": 4, "wait_ms": -1}, "out of range"),
        ({"max_batch_size": 4, "wait_ms": "5"}, "milliseconds"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        ember.batched(**kwargs)


def test_generators_cannot_be_batched() -> None:
    def numbers(xs: list[int]):  # type: ignore[no-untyped-def]
        yield from xs

    with pytest.raises(InvalidError, match="streams cannot be batched"):
        ember.batched(max_batch_size=4, wait_ms=5)(numbers)


def test_concurrency_must_admit_a_whole_batch() -> None:
    with pytest.raises(InvalidError, match=r"concurrency=8\) or more"):

        @ember.endpoint(concurrency=2)
        @ember.batched(max_batch_size=8, wait_ms=5)
        def embed(texts: list[str]) -> list[int]:
            return [len(t) for t in texts]

    @ember.endpoint(concurrency=8)
    class Model:
        @ember.method
        @ember.batched(max_batch_size=8, wait_ms=5)
        def embed(self, texts: list[str]) -> list[int]:
            return [len(t) for t in texts]

    assert batch_settings(Model.target.embed) == BatchSettings(8, 5.0)


def run_batches(func: Any, inputs: list[dict[str, Any]], size: int, wait_ms: float = 20.0):
    async def main() -> tuple[list[Any], list[int]]:
        with ThreadPoolExecutor(2) as pool:
            batcher = Batcher(func, BatchSettings(size, wait_ms), pool)
            results = await asyncio.gather(
                *(batcher.submit(kwargs) for kwargs in inputs), return_exceptions=True
            )
            return list(results), batcher.sizes

    return asyncio.run(main())


def test_concurrent_inputs_share_calls_and_keep_their_order() -> None:
    calls: list[list[int]] = []

    def double(x: list[int], scale: list[int]) -> list[int]:
        calls.append(list(x))
        return [a * b for a, b in zip(x, scale, strict=True)]

    def with_default(x: list[int], scale: list[int] = 2) -> list[int]:  # type: ignore[assignment]
        return double(x, scale)

    results, sizes = run_batches(with_default, [{"x": i} for i in range(10)], size=4)
    assert results == [2 * i for i in range(10)]  # as one at a time, in order
    assert sizes == [4, 4, 2] and calls[0] == [0, 1, 2, 3]


def test_a_lone_input_runs_after_the_wait() -> None:
    results, sizes = run_batches(lambda x: [v + 1 for v in x], [{"x": 1}], size=8, wait_ms=10)
    assert results == [2] and sizes == [1]


def test_async_functions_are_batched_too() -> None:
    async def shout(text: list[str]) -> list[str]:
        await asyncio.sleep(0)
        return [t.upper() for t in text]

    results, sizes = run_batches(shout, [{"text": t} for t in "abc"], size=3)
    assert results == ["A", "B", "C"] and sizes == [3]


@pytest.mark.parametrize(
    ("returned", "error"),
    [(lambda x: x[:-1], BatchResultError), (lambda x: 5, BatchResultError)],
)
def test_a_wrong_number_of_results_fails_every_input(returned: Any, error: type) -> None:
    results, _ = run_batches(returned, [{"x": i} for i in range(3)], size=3)
    assert all(isinstance(r, error) for r in results)
    assert "one result per input (3)" in str(results[0])


def test_an_exception_reaches_every_input_of_its_batch() -> None:
    def fail(x: list[int]) -> list[int]:
        raise ValueError("bad batch")

    results, _ = run_batches(fail, [{"x": i} for i in range(2)], size=2)
    assert [type(r) for r in results] == [ValueError, ValueError]
