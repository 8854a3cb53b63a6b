"""`ember.cancelled()`: each input's flag, seen by the thread or task that runs it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import ember
from ember import cancellation


def test_outside_an_input_nothing_is_cancelled() -> None:
    assert ember.cancelled() is False


def test_a_thread_sees_its_own_inputs_flag_only() -> None:
    mine, other = threading.Event(), threading.Event()
    other.set()
    with ThreadPoolExecutor(max_workers=1) as pool:
        seen = pool.submit(cancellation.bound(mine, ember.cancelled)).result()
        assert seen is False
        mine.set()
        assert pool.submit(cancellation.bound(mine, ember.cancelled)).result() is True
        # The thread serves another input next; a call outside any sees nothing.
        assert pool.submit(cancellation.bound(threading.Event(), ember.cancelled)).result() is False
        assert pool.submit(ember.cancelled).result() is False


def test_an_async_input_sees_its_tasks_flag() -> None:
    async def run(flag: threading.Event) -> tuple[bool, bool]:
        cancellation.bind_task(flag)
        before = ember.cancelled()
        flag.set()
        await asyncio.sleep(0)
        return before, ember.cancelled()

    async def both() -> list[tuple[bool, bool]]:
        return list(await asyncio.gather(run(threading.Event()), run(threading.Event())))

    assert asyncio.run(both()) == [(False, True), (False, True)]
    assert ember.cancelled() is False  # the tasks' flags stayed in their tasks
