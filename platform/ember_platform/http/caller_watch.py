"""Noticing that a caller hung up while its call is served, at little cost per call.

ASGI tells an app of a disconnect only through `receive()`, which must be awaited in a
task of its own while the app waits for the answer. Most calls are answered within
milliseconds, so that task is made only once a call has waited `WATCH_AFTER_S`: a fast
call costs one timer instead of a task, its wake-ups and its cancellation. A caller who
leaves sooner is noticed that much later (its work is stopped 20 ms late).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ember_platform.edge.asgi_types import Receive

WATCH_AFTER_S = 0.02


class CallerWatch:
    """While open, `on_gone` runs once if the caller disconnects; `gone` says whether
    it did."""

    def __init__(
        self, receive: Receive, on_gone: Callable[[], None], loop: asyncio.AbstractEventLoop
    ) -> None:
        # The loop is given: asking asyncio for the running one costs a system call
        # (getpid, on Python 3.11), once per call.
        self._receive = receive
        self._on_gone = on_gone
        self.gone = False
        self._loop = loop
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = loop.call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = self._loop.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._on_gone()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def __enter__(self) -> CallerWatch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> Any:
        self.close()
        return None
