"""A web app's ASGI lifespan as the replica runs it: startup, state, failure, shutdown,
and apps that speak no lifespan at all."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ember_worker.replica.web_apps.asgi_lifespan import AppLifespan, LifespanFailed


def speaking(events: list[str], *, fail: bool = False) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if fail:
                    await send({"type": "lifespan.startup.failed", "message": "no model"})
                    return
                scope["state"]["model"] = "ready"
                events.append("startup")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                events.append("shutdown")
                await send({"type": "lifespan.shutdown.complete"})
                return

    return app


def test_startup_sets_the_state_and_shutdown_runs() -> None:
    events: list[str] = []

    async def main() -> None:
        lifespan = AppLifespan(speaking(events))
        await lifespan.startup()
        assert lifespan.state == {"model": "ready"}
        await lifespan.shutdown()

    asyncio.run(main())
    assert events == ["startup", "shutdown"]


def test_a_failed_startup_says_why() -> None:
    async def main() -> None:
        with pytest.raises(LifespanFailed, match="no model"):
            await AppLifespan(speaking([], fail=True)).startup()

    asyncio.run(main())


def test_an_app_without_a_lifespan_is_served_without_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def plain(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"unsupported scope {scope['type']}")

    async def main() -> None:
        lifespan = AppLifespan(plain)
        await lifespan.startup()  # no error: served as it is
        await lifespan.shutdown()

    asyncio.run(main())
    assert "runs no lifespan (ValueError: unsupported scope lifespan)" in capsys.readouterr().err
