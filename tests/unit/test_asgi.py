"""Web-app endpoints: the decorator's checks, the wire form of requests and responses,
and the path a request has inside the app."""

from __future__ import annotations

import pytest

import ember
from ember.endpoints.asgi import (
    RESPONSE_CHUNK_BYTES,
    HttpRequest,
    decode_response_body,
    decode_response_start,
    decode_websocket_message,
    decode_whole_response,
    encode_websocket_message,
    is_asgi_factory,
    is_wsgi_factory,
    response_body_events,
    response_start_event,
    whole_response,
)
from ember.errors import InvalidError
from ember.wire.labels import route_request
from ember_platform.http.web_apps import app_path, forwarded_headers


def test_a_web_app_endpoint_is_its_own_kind_with_one_streaming_method() -> None:
    @ember.endpoint(public=True)
    @ember.asgi_app()
    def web(debug: bool = False):  # type: ignore[no-untyped-def]
        return None

    assert web.kind == "asgi"
    (method,) = web.methods.values()
    assert method.streaming


def test_the_decorators_refuse_what_cannot_work() -> None:
    with pytest.raises(InvalidError, match="needs a default"):

        @ember.endpoint()
        @ember.asgi_app()
        def needs(config: str):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(InvalidError, match="goes under"):

        @ember.asgi_app()
        @ember.endpoint()
        def upside_down():  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(InvalidError, match="cannot have a schedule"):

        @ember.endpoint(schedule=ember.Period(minutes=1))
        @ember.asgi_app()
        def timed():  # type: ignore[no-untyped-def]
            return None


def test_a_wsgi_app_is_a_web_app_endpoint_too_and_marked_once() -> None:
    @ember.endpoint()
    @ember.wsgi_app()
    def classic():  # type: ignore[no-untyped-def]
        return None

    assert classic.kind == "asgi"
    assert is_wsgi_factory(classic.target) and is_asgi_factory(classic.target)
    with pytest.raises(InvalidError, match="web app twice"):

        @ember.wsgi_app()
        @ember.asgi_app()
        def both():  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(InvalidError, match=r"@ember.wsgi_app\(\) marks a function that returns"):

        @ember.endpoint()
        @ember.wsgi_app()
        def generator():  # type: ignore[no-untyped-def]
            yield None


def test_requests_keep_bytes_and_headers_through_the_wire() -> None:
    request = HttpRequest(
        method="POST",
        path="/app--web/upload",
        root_path="/app--web",
        query_string=b"a=1&b=%C3%A9",
        headers=[(b"content-type", b"application/octet-stream"), (b"x-latin", b"caf\xe9")],
        body=bytes(range(256)),
        client=("127.0.0.1", 5555),
    )
    decoded = HttpRequest.decode(request.encode().decode())
    assert decoded == request
    scope = decoded.scope()
    assert scope["type"] == "http" and scope["root_path"] == "/app--web"
    assert scope["raw_path"] == b"/app--web/upload" and scope["client"] == ("127.0.0.1", 5555)


def test_responses_drop_hop_by_hop_headers_and_chunk_large_bodies() -> None:
    start = response_start_event(
        201, [(b"content-type", b"text/plain"), (b"Transfer-Encoding", b"chunked")]
    )
    assert decode_response_start(start.encode()) == (201, [(b"content-type", b"text/plain")])
    body = b"\x00\xff" * RESPONSE_CHUNK_BYTES  # two chunks' worth
    events = list(response_body_events(body))
    assert len(events) == 2
    assert b"".join(decode_response_body(e.encode()) for e in events) == body
    assert list(response_body_events(b"")) == []


def test_the_apps_path_starts_with_its_root_path() -> None:
    route = route_request("127.0.0.1:8443", "/app--web/a/b", None)
    assert route is not None
    assert app_path({"path": "/app--web/a/b"}, route) == "/app--web/a/b"
    doubled = route_request("127.0.0.1:8443", "//app--web//a", None)
    assert doubled is not None
    assert app_path({"path": "//app--web//a"}, doubled) == "/app--web/a"
    by_host = route_request("app--web.example.com", "/a/b", "example.com")
    assert by_host is not None and by_host.root_path == ""
    assert app_path({"path": "/a/b"}, by_host) == "/a/b"


def test_a_private_apps_authorization_header_is_not_passed_on() -> None:
    headers = [(b"authorization", b"Bearer emb_x"), (b"accept", b"*/*")]
    assert forwarded_headers(headers, public=False) == [(b"accept", b"*/*")]
    assert forwarded_headers(headers, public=True) == headers


def test_websocket_messages_keep_text_bytes_and_headers() -> None:
    for message in (
        {"type": "websocket.send", "text": "hi", "bytes": None},
        {"type": "websocket.send", "bytes": b"\x00\xff"},
        {"type": "websocket.accept", "subprotocol": "chat", "headers": [(b"x-a", b"1")]},
        {"type": "websocket.close", "code": 4000, "reason": "bye"},
    ):
        decoded = decode_websocket_message(encode_websocket_message(message))
        assert decoded == {k: v for k, v in message.items() if v is not None}


def test_a_websocket_request_has_a_websocket_scope_with_its_subprotocols() -> None:
    request = HttpRequest(
        method="GET",
        path="/app--web/chat",
        root_path="/app--web",
        query_string=b"",
        headers=[(b"sec-websocket-protocol", b"a, b")],
        body=b"",
        kind="websocket",
    )
    scope = HttpRequest.decode(request.encode().decode()).scope()
    assert scope["type"] == "websocket" and scope["subprotocols"] == ["a", "b"]


def test_a_whole_response_travels_as_one_result() -> None:
    headers = [(b"content-type", b"text/plain"), (b"connection", b"close")]
    whole = whole_response(404, headers, b"no")
    assert decode_whole_response(whole.encode()) == (404, headers[:1], b"no")
