"""The watch for a caller who hangs up: no task for a call answered at once, `on_gone`
once for one that waits and loses its caller."""

from __future__ import annotations

import asyncio
from typing import Any

from ember_platform.http.caller_watch import WATCH_AFTER_S, CallerWatch


def test_a_call_answered_at_once_never_listens() -> None:
    asked: list[str] = []

    async def receive() -> dict[str, Any]:
        asked.append("receive")
        return {"type": "http.disconnect"}

    async def scenario() -> bool:
        with CallerWatch(
            receive, lambda: asked.append("gone"), asyncio.get_running_loop()
        ) as watch:
            await asyncio.sleep(0)  # answered well within WATCH_AFTER_S
        await asyncio.sleep(WATCH_AFTER_S * 2)
        return watch.gone

    assert asyncio.run(scenario()) is False
    assert asked == []


def test_a_caller_who_leaves_while_waiting_is_noticed_once() -> None:
    messages = asyncio.Queue[dict[str, Any]]()
    gone: list[str] = []

    async def scenario() -> bool:
        with CallerWatch(
            messages.get, lambda: gone.append("gone"), asyncio.get_running_loop()
        ) as watch:
            await messages.put({"type": "http.request", "body": b""})  # not a hang-up
            await asyncio.sleep(WATCH_AFTER_S * 2)
            assert gone == [] and not watch.gone
            await messages.put({"type": "http.disconnect"})
            for _ in range(100):
                if watch.gone:
                    break
                await asyncio.sleep(0.001)
        return watch.gone

    assert asyncio.run(scenario()) is True
    assert gone == ["gone"]


def test_closing_stops_listening() -> None:
    cancelled: list[str] = []

    async def receive() -> dict[str, Any]:
        try:
            await asyncio.Future()  # a caller who stays
        except asyncio.CancelledError:
            cancelled.append("stopped")
            raise
        return {}

    async def scenario() -> None:
        with CallerWatch(receive, lambda: None, asyncio.get_running_loop()):
            await asyncio.sleep(WATCH_AFTER_S * 2)
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert cancelled == ["stopped"]
