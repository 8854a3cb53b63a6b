"""Which browser origins an endpoint lets call it, and what the gateway answers them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import ember
from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember_platform.edge.cors import (
    allowed_origin,
    answer_preflight,
    is_preflight,
    with_cors_headers,
)


def test_origins_are_checked_when_the_decorator_runs() -> None:
    ok = ["https://app.example.com", "http://localhost:3000", "http://[::1]:8080", "*"]
    assert EndpointSettings(cors_origins=ok).cors_origins == ok
    for bad in (
        ["https://app.example.com/"],  # a path is not part of an origin
        ["app.example.com"],
        ["ftp://files.example.com"],
        ["https://a.example.com/page"],
        ["https://app.example.com\n"],
        "https://app.example.com",  # a string, not a list
        [1],
    ):
        with pytest.raises(InvalidError, match="cors_origins"):
            EndpointSettings(cors_origins=bad)  # type: ignore[arg-type]
    settings = EndpointSettings.from_dict(EndpointSettings(cors_origins=["*"]).to_dict())
    assert settings.cors_origins == ["*"]
    assert EndpointSettings.from_dict({}).cors_origins == []  # manifests from before


def test_a_web_app_answers_cors_itself() -> None:
    with pytest.raises(InvalidError, match="CORSMiddleware"):

        @ember.endpoint(cors_origins=["*"])
        @ember.asgi_app()
        def web() -> Any:
            return None


def test_only_listed_origins_are_allowed() -> None:
    page = {b"origin": b"https://App.Example.com"}
    assert allowed_origin(["https://app.example.com"], page) == b"https://App.Example.com"
    assert allowed_origin(["https://other.example.com"], page) is None
    assert allowed_origin(["*"], page) == b"https://App.Example.com"
    assert allowed_origin([], page) is None
    assert allowed_origin(["*"], {}) is None  # not a cross-origin call
    assert is_preflight("OPTIONS", {b"access-control-request-method": b"POST"})
    assert not is_preflight("OPTIONS", {}) and not is_preflight("POST", {})


def _sent(coroutine_of_send: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(coroutine_of_send(send))
    return messages


def test_preflight_and_answer_headers() -> None:
    origin = b"https://app.example.com"
    start, body = _sent(lambda send: answer_preflight(send, origin, {}))
    headers = dict(start["headers"])
    assert start["status"] == 204 and body["body"] == b""
    assert headers[b"access-control-allow-origin"] == origin
    assert b"authorization" in headers[b"access-control-allow-headers"]

    async def answer(send: Any) -> None:
        wrapped = with_cors_headers(send, origin)
        await wrapped({"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]})
        await wrapped({"type": "http.response.body", "body": b"{}"})

    start, body = _sent(answer)
    headers = dict(start["headers"])
    assert headers[b"a"] == b"b" and headers[b"access-control-allow-origin"] == origin
    assert headers[b"vary"] == b"origin" and body == {"type": "http.response.body", "body": b"{}"}
