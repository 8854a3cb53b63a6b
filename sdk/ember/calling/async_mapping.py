"""`Endpoint.amap`: `map` for asyncio code. Many inputs through one endpoint method as
tasks on the caller's event loop, over the loop's kept connections (`connections.py`),
with the platform's back-pressure (429 queue_full) waited out, not failed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Iterable, Mapping
from typing import Any

import httpx

from ember.calling.call_bodies import call_body
from ember.calling.mapping import (
    BACKLOG_PER_SLOT,
    checked_input,
    no_answer_in_time,
    outcome,
    read_answer,
)
from ember.errors import InvalidError, RemoteError


async def apost_until_queued(
    client: httpx.AsyncClient,
    url: str,
    arguments: Mapping[str, Any],
    error_from_response: Callable[[int, bytes], RemoteError],
    headers: dict[str, str] | None = None,
    timeout: httpx.Timeout | None = None,
) -> Any:
    """One call; while the endpoint's queue is full, wait as it asks and send it again
    (the input was not taken, so nothing runs twice). A generator's result is the list
    of what it yielded."""
    limit = httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
    while True:
        try:
            response = await client.post(url, **call_body(arguments, headers), timeout=limit)
        except httpx.TimeoutException as exc:
            raise no_answer_in_time(exc) from None
        answered, value = read_answer(response, error_from_response)
        if answered:
            return value
        await asyncio.sleep(value)


async def _numbered(
    inputs: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
) -> AsyncGenerator[tuple[int, Mapping[str, Any]], None]:
    if isinstance(inputs, AsyncIterable):
        index = 0
        async for item in inputs:
            yield index, checked_input(index, item)
            index += 1
    else:
        for index, item in enumerate(inputs):
            yield index, checked_input(index, item)


async def amap_calls(
    call: Callable[[Mapping[str, Any]], Awaitable[Any]],
    inputs: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
    *,
    concurrency: int,
    order_outputs: bool,
    return_exceptions: bool,
) -> AsyncGenerator[tuple[int, Any], None]:
    """Run `call` over `inputs`, `concurrency` at once, and yield (input index, result),
    in input order or as they finish. A failed input raises (with a note naming it)
    unless `return_exceptions`, which yields its RemoteError in its place. Leaving early,
    by an error or by closing the iterator, cancels the calls in flight: their
    connections close, so the platform stops their inputs."""
    if concurrency < 1:
        raise InvalidError(f"concurrency must be at least 1, not {concurrency}")
    numbered = _numbered(inputs)
    backlog = concurrency * BACKLOG_PER_SLOT
    slots = asyncio.Semaphore(concurrency)

    async def in_slot(arguments: Mapping[str, Any]) -> Any:
        async with slots:
            return await call(arguments)

    running: dict[asyncio.Task[Any], int] = {}
    finished: dict[int, asyncio.Task[Any]] = {}
    next_to_yield = 0
    exhausted = False
    try:
        while True:
            while not exhausted and len(running) + len(finished) < backlog:
                entry = await anext(numbered, None)
                if entry is None:
                    exhausted = True
                    break
                index, arguments = entry
                running[asyncio.ensure_future(in_slot(arguments))] = index
            if not running and not finished:
                return
            if running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    finished[running.pop(task)] = task
            if order_outputs:
                while next_to_yield in finished:
                    task = finished.pop(next_to_yield)
                    yield next_to_yield, outcome(task, next_to_yield, return_exceptions)
                    next_to_yield += 1
            else:
                for index in sorted(finished):
                    yield index, outcome(finished.pop(index), index, return_exceptions)
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        for task in finished.values():
            if not task.cancelled():
                task.exception()  # retrieved: no "never retrieved" warning for dropped ones
        await numbered.aclose()
