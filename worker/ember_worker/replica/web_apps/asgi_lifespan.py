"""An ASGI app's lifespan (FastAPI's `lifespan=`, Starlette's `on_startup`): its startup
runs once the replica has its identity (after any restore, so what it opens is live), its
shutdown as the replica drains. The state it sets is each request's `scope["state"]`.

An app that does not speak the protocol (it raises for a `lifespan` scope) is served
without one, as uvicorn's default does."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

SHUTDOWN_SECONDS = 30.0


class LifespanFailed(Exception):
    """The app said its startup failed (`lifespan.startup.failed`), or raised there."""


class AppLifespan:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        scope = {
            "type": "lifespan",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "state": self.state,
        }
        self._task = asyncio.ensure_future(self.app(scope, self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        answer = await self._answer()
        if answer is None:
            return  # no lifespan spoken: served without one
        if answer["type"] == "lifespan.startup.failed":
            raise LifespanFailed(answer.get("message") or "the web app's startup failed")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        try:
            answer = await asyncio.wait_for(self._answer(), SHUTDOWN_SECONDS)
        except TimeoutError:
            print("ember: the web app's lifespan shutdown did not finish", file=sys.stderr)
            self._task.cancel()
            return
        if answer is not None and answer["type"] == "lifespan.shutdown.failed":
            print(f"ember: the web app's shutdown failed: {answer.get('message')}", file=sys.stderr)

    async def _answer(self) -> dict[str, Any] | None:
        """The app's next lifespan message; None when it ended without one (an app that
        raises for a lifespan scope has none; Starlette's own failure is a message)."""
        assert self._task is not None  # started
        sent = asyncio.ensure_future(self._outbox.get())
        await asyncio.wait({sent, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if sent.done():
            return sent.result()
        sent.cancel()
        error = None if self._task.cancelled() else self._task.exception()
        if error is not None:
            print(
                f"ember: the web app runs no lifespan ({type(error).__name__}: {error}); "
                "served without one",
                file=sys.stderr,
            )
        return None
