"""A WSGI app served as an ASGI app: PEP 3333's environ, the response as it is written
(one message when it is one chunk), errors, and a caller who leaves mid-response."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ember import cancellation
from ember_worker.replica.web_apps.wsgi_bridge import (
    WsgiBridge,
    host_and_port,
    status_code,
    wsgi_environ,
)

SCOPE: dict[str, Any] = {
    "type": "http",
    "method": "POST",
    "path": "/shop--web/items/ünï",
    "root_path": "/shop--web",
    "query_string": b"page=2&q=a%20b",
    "headers": [
        (b"host", b"ember.example:443"),
        (b"content-type", b"application/json"),
        (b"content-length", b"999"),
        (b"x-tag", b"one"),
        (b"x-tag", b"two"),
    ],
    "client": ("10.0.0.7", 51000),
    "scheme": "https",
    "http_version": "1.1",
}


def serve(app: Callable[..., Any], body: bytes = b"", scope: dict[str, Any] = SCOPE) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        with ThreadPoolExecutor(2) as pool:
            await WsgiBridge(app, pool)(scope, receive, send)

    asyncio.run(main())
    return sent


def test_the_environ_is_pep_3333s() -> None:
    environ = wsgi_environ(SCOPE, b'{"a": 1}')
    assert environ["REQUEST_METHOD"] == "POST"
    assert environ["SCRIPT_NAME"] == "/shop--web"
    assert environ["PATH_INFO"] == "/items/ünï".encode().decode("latin-1")
    assert environ["QUERY_STRING"] == "page=2&q=a%20b"
    assert environ["CONTENT_TYPE"] == "application/json"
    assert environ["CONTENT_LENGTH"] == "8"  # the body's, not the header's
    assert environ["HTTP_X_TAG"] == "one,two"
    assert (environ["SERVER_NAME"], environ["SERVER_PORT"]) == ("ember.example", "443")
    assert environ["REMOTE_ADDR"] == "10.0.0.7"
    assert environ["wsgi.url_scheme"] == "https"
    assert environ["wsgi.input"].read() == b'{"a": 1}'
    assert "HTTP_CONTENT_LENGTH" not in environ and "HTTP_CONTENT_TYPE" not in environ


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("ember.example", ("ember.example", "443")),
        ("127.0.0.1:8443", ("127.0.0.1", "8443")),
        ("[::1]:8443", ("[::1]", "8443")),
        ("[::1]", ("[::1]", "443")),
    ],
)
def test_the_host_header_gives_the_server_name_and_port(
    host: str, expected: tuple[str, str]
) -> None:
    assert host_and_port(host) == expected


def test_a_path_outside_the_root_keeps_it_whole() -> None:
    environ = wsgi_environ({**SCOPE, "path": "/elsewhere"}, b"")
    assert (environ["SCRIPT_NAME"], environ["PATH_INFO"]) == ("", "/elsewhere")
    assert "CONTENT_LENGTH" not in environ


def test_a_one_chunk_response_is_one_message() -> None:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        body = environ["wsgi.input"].read()
        start_response("201 Created", [("Content-Type", "text/plain"), ("X-Seen", "yes")])
        return [b"got " + body]

    sent = serve(app, b"hello")
    assert sent == [
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"content-type", b"text/plain"), (b"x-seen", b"yes")],
        },
        {"type": "http.response.body", "body": b"got hello", "more_body": False},
    ]


def test_chunks_and_writes_stream_in_order_and_close_is_called() -> None:
    closed = threading.Event()

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            yield b"a"
            yield b""  # an empty chunk sends nothing
            yield b"b"

        def close(self) -> None:
            closed.set()

    def app(environ: dict, start_response: Callable) -> Body:
        write = start_response("200 OK", [])
        write(b"early")
        return Body()

    sent = serve(app)
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(b"early", True), (b"a", True), (b"b", False)]
    assert closed.is_set()


def test_an_empty_body_still_ends_the_response() -> None:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        start_response("204 No Content", [])
        return []

    sent = serve(app)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_an_app_that_raises_before_answering_raises_and_sends_nothing() -> None:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        raise KeyError("missing")

    with pytest.raises(KeyError):
        serve(app)

    def forgetful(environ: dict, start_response: Callable) -> list[bytes]:
        return [b"no status"]

    with pytest.raises(RuntimeError, match="before calling start_response"):
        serve(forgetful)


def test_an_error_page_may_replace_a_status_not_yet_sent() -> None:
    def app(environ: dict, start_response: Callable) -> list[bytes]:
        start_response("200 OK", [])
        try:
            raise ValueError("broken")
        except ValueError:
            import sys

            start_response("500 Internal Server Error", [], sys.exc_info())
        return [b"sorry"]

    assert serve(app)[0]["status"] == 500


@pytest.mark.parametrize("status", ["OK", "20 OK", "abc Nope"])
def test_a_status_without_a_code_is_refused(status: str) -> None:
    with pytest.raises(ValueError, match="3-digit"):
        status_code(status)


def test_a_caller_leaving_stops_the_apps_writes_and_waits_for_its_thread() -> None:
    wrote_first = threading.Event()
    outcome: list[str] = []

    def app(environ: dict, start_response: Callable) -> Iterator[bytes]:
        start_response("200 OK", [])
        try:
            yield b"1"
            yield b"2"  # the first goes out as this one comes
            wrote_first.set()
            while not cancellation.cancelled():
                threading.Event().wait(0.01)
            outcome.append("saw the flag")
            yield b"3"
            yield b"4"  # the write of 3 raises in the bridge, which stops the generator
        except GeneratorExit:
            outcome.append("closed")
            raise

    async def main() -> list[dict]:
        sent: list[dict] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        flag = cancellation.InputFlag("c-1")
        with ThreadPoolExecutor(2) as pool:

            async def request() -> None:
                cancellation.bind_task(flag)
                await WsgiBridge(app, pool)(SCOPE, receive, send)

            task = asyncio.ensure_future(request())
            await asyncio.to_thread(wrote_first.wait, 10)
            flag.set()  # what the runtime does as it cancels the input's task
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert outcome == ["saw the flag", "closed"]  # its thread ended first
        return sent

    sent = asyncio.run(main())
    assert [m.get("body") for m in sent[1:]] == [b"1"]


def test_websocket_handshakes_are_refused() -> None:
    sent = serve(lambda environ, start_response: [], scope={"type": "websocket"})
    assert sent == [{"type": "websocket.close", "code": 1003}]
