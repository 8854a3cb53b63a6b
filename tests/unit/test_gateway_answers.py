"""What the gateway answers whatever goes wrong inside it: JSON, like its other errors."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from ember_platform.http.call_requests import prefers_async
from ember_platform.http.gateway import Gateway


def test_a_failure_of_the_platform_is_a_json_500_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gateway = Gateway.__new__(Gateway)  # only __call__ and its failing _handle are used

    async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RecursionError("deep in a parser")

    gateway._handle = broken  # type: ignore[method-assign]
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/app--echo/", "headers": []}
    with caplog.at_level(logging.ERROR):
        asyncio.run(gateway(scope, None, send))  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    assert (b"content-type", b"application/json") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["type"] == "internal_error" and "log says why" in error["message"]
    assert "POST /app--echo/ failed" in caplog.text and "deep in a parser" in caplog.text


def test_a_failure_after_the_answer_began_sends_nothing_more() -> None:
    gateway = Gateway.__new__(Gateway)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if sent and message["type"] == "http.response.start":
            raise RuntimeError("the response has started")  # as uvicorn refuses it
        sent.append(message)

    async def half(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise ValueError("midway")

    gateway._handle = half  # type: ignore[method-assign]
    scope = {"type": "http", "method": "GET", "path": "/x/", "headers": []}
    asyncio.run(gateway(scope, None, send))  # type: ignore[arg-type]
    assert [m["type"] for m in sent] == ["http.response.start"]


@pytest.mark.parametrize(
    ("prefer", "wanted"),
    [
        (b"respond-async", True),
        (b"Respond-Async", True),
        (b"return=minimal, respond-async", True),
        (b"respond-async; wait=10", True),
        (b"wait=5,respond-async", True),
        (b"no-respond-async", False),
        (b"respond-asynchronously", False),
        (b"return=respond-async", False),
        (b"", False),
    ],
)
def test_prefer_asks_for_an_async_answer_only_by_its_own_token(prefer: bytes, wanted: bool) -> None:
    assert prefers_async(prefer) is wanted
