"""Web-app endpoints (`@ember.asgi_app()`): every method and path under the endpoint's
URL reaches the app, with its root path; bodies are bytes both ways; responses stream;
tokens guard private apps and are not passed to them; failures get clear answers."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Platform, wait_for
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from ember.calling.tlsclient import client_context

APP = "webs"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "webapp.py", APP)


def test_every_method_and_path_reaches_the_app_under_its_root_path(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        response = client.get(f"/{APP}--web/info", params={"a": "1", "b": "two"})
        assert response.status_code == 200, response.text
        info = response.json()
        assert info["app"] == "private" and info["method"] == "GET"
        assert info["path"] == f"/{APP}--web/info"
        assert info["root_path"] == f"/{APP}--web"
        assert info["query"] == {"a": "1", "b": "two"}
        assert info["url_for_echo"].endswith(f"/{APP}--web/echo")
        assert info["authorization"] is None  # the Ember token stays with the platform
        assert response.headers["x-ember-call-id"].startswith("c-")
        assert client.delete(f"/{APP}--web/info").json()["method"] == "DELETE"
        assert client.put(f"/{APP}--web/info").json()["method"] == "PUT"
        assert client.get(f"/{APP}--web/nowhere").status_code == 404  # the app's own 404
        assert client.post(f"/{APP}--web/info").status_code == 405  # and its own 405
        assert client.get(f"/{APP}--web/sync").text == "from a thread"
        # Sticky sessions: the affinity header routes a web app's requests too.
        sticky = client.get(f"/{APP}--web/info", headers={"X-Ember-Affinity": "user-7"})
        assert sticky.json()["method"] == "GET"
        unsticky = client.get(f"/{APP}--web/info", headers={"X-Ember-Affinity": "x" * 300})
        assert unsticky.status_code == 400 and "X-Ember-Affinity" in unsticky.text
    # At the endpoint's own host name, the app is at the root.
    port = platform.url.rsplit(":", 1)[1]
    host = f"{APP}--web.ember.localhost"
    result = platform.curl(
        "--resolve",
        f"{host}:{port}:127.0.0.1",
        "-H",
        f"Authorization: Bearer {platform.token}",
        f"https://{host}:{port}/info",
    )
    assert result.returncode == 0, result.stderr
    by_host = json.loads(result.stdout)
    assert (by_host["path"], by_host["root_path"]) == ("/info", "")


def test_the_app_sees_the_raw_path_with_its_escapes(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        seen = client.get(f"/{APP}--web/raw/a%2Fb%20c").json()
    assert seen == {"path": f"/{APP}--web/raw/a/b c", "raw_path": f"/{APP}--web/raw/a%2Fb%20c"}


def test_an_apps_lifespan_runs_and_its_state_reaches_the_requests(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        answer = client.get(f"/{APP}--lifespan-web/model")
        assert answer.json() == {"model": "loaded in the lifespan"}, answer.text
        failed = client.get(f"/{APP}--failing-lifespan-web/model")
    assert failed.status_code == 500 and "the model is missing" in failed.text
    # Its shutdown runs as the replica stops.
    rows = json.loads(platform.ember("replica", "ls", APP, "--json").stdout)
    [replica] = [r for r in rows if r["endpoint"] == "lifespan-web"]
    platform.ember("replica", "stop", replica["id"])
    wait_for(
        lambda: "lifespan shutdown" in platform.ember("logs", f"{APP}/lifespan-web").stdout, 30
    )


def test_bodies_are_bytes_both_ways_with_the_apps_status_and_headers(
    platform: Platform, deployed: dict[str, str]
) -> None:
    payload = bytes(range(256)) * 4096 + b"\xff\xfe"  # 1 MiB and a bit, not UTF-8
    with platform.client() as client:
        response = client.post(
            f"/{APP}--web/echo",
            content=payload,
            headers={"content-type": "application/x-test"},
        )
    assert response.status_code == 201
    assert response.content == payload
    assert response.headers["content-type"] == "application/x-test"
    assert response.headers["x-echoed-bytes"] == str(len(payload))


def test_a_streaming_response_arrives_chunk_by_chunk(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with (
        platform.client() as client,
        client.stream("GET", f"/{APP}--web/stream", params={"n": "4", "delay": "0.2"}) as response,
    ):
        assert response.status_code == 200
        pieces = list(response.iter_raw())
    assert b"".join(pieces) == b"".join(f"chunk {i}\n".encode() for i in range(4))
    assert len(pieces) >= 2  # not buffered into one


def test_a_response_that_fails_midway_is_cut_short_not_passed_off_as_whole(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        params = {"n": "4", "delay": "0.05", "fail_at": "2"}
        with client.stream("GET", f"/{APP}--web/stream", params=params) as response:
            assert response.status_code == 200  # sent before the failure
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                for piece in response.iter_raw():
                    received += piece
    assert received == b"chunk 0\nchunk 1\n"


def test_a_request_past_its_timeout_stops_alone_and_its_neighbours_finish_once(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--hasty-web"
    with platform.client() as client, ThreadPoolExecutor(max_workers=2) as pool:
        assert client.get(f"/{label}/nap").text == "slept 0"  # its replica up first
        too_long = pool.submit(client.get, f"/{label}/nap", params={"s": "60"})
        wait_for(lambda: platform.endpoint_status(label)["running"] == 1, 30)
        # Running when the first one's 4 s are up, and done within its own.
        time.sleep(2)
        beside = pool.submit(client.get, f"/{label}/nap", params={"s": "2.5"})
        assert too_long.result(timeout=30).status_code == 504
        answer = beside.result(timeout=30)
        assert (answer.status_code, answer.text) == (200, "slept 2.5")
    logs = platform.ember("logs", f"{APP}/hasty-web").stdout
    assert logs.count("nap of 2.5 s begins") == 1, logs  # not run again on a new replica
    assert "replica lost" not in logs


def test_tokens_guard_a_private_app_and_pass_through_to_a_public_one(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with httpx.Client(base_url=platform.url, verify=client_context(platform.ca)) as anonymous:
        assert anonymous.get(f"/{APP}--web/info").status_code == 401
        public = anonymous.get(
            f"/{APP}--open-web/info", headers={"Authorization": "Bearer app-own-token"}
        )
    assert public.status_code == 200
    assert public.json()["app"] == "public"
    assert public.json()["authorization"] == "Bearer app-own-token"


def test_failures_get_clear_answers(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        failed = client.get(f"/{APP}--web/fail")
        assert failed.status_code == 500  # Starlette's own error page
        broken = client.get(f"/{APP}--not-an-app/")
        assert broken.status_code == 500
        assert "not an ASGI app" in broken.text
    # The replica prints the traceback as (or after) it answers: its output may still be
    # on its way.
    wait_for(lambda: "the route failed" in platform.ember("logs", f"{APP}/web").stdout, 10)


def test_a_caller_leaving_mid_stream_closes_the_apps_stream(
    platform: Platform, deployed: dict[str, str]
) -> None:
    endless = {"n": "1000", "delay": "0.05"}
    with (
        platform.client() as client,
        client.stream("GET", f"/{APP}--web/stream", params=endless) as response,
    ):
        iterator = response.iter_raw()
        assert next(iterator).startswith(b"chunk 0")
    wait_for(lambda: "stream closed" in platform.ember("logs", f"{APP}/web").stdout, 30)


def _ws_url(platform: Platform, endpoint: str, path: str) -> str:
    return platform.url.replace("https://", "wss://") + f"/{APP}--{endpoint}/{path}"


def _session(platform: Platform, endpoint: str, path: str, **options: Any) -> ClientConnection:
    """A WebSocket session with the endpoint; a handshake that times out fails with what
    the platform says of the endpoint (its replicas, queue and log)."""
    try:
        return connect(
            _ws_url(platform, endpoint, path),
            ssl=client_context(platform.ca),
            open_timeout=60,
            **options,
        )
    except TimeoutError:
        status = platform.endpoint_status(f"{APP}--{endpoint}")
        logs = platform.ember("logs", f"{APP}/{endpoint}", "-n", "60").stdout
        raise AssertionError(f"no handshake in 60 s; endpoint: {status}\nlogs:\n{logs}") from None


def test_a_websocket_session_carries_text_and_bytes_both_ways(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with _session(
        platform,
        "web",
        "chat",
        additional_headers={"Authorization": f"Bearer {platform.token}"},
        subprotocols=[Subprotocol("ember.test")],
    ) as ws:
        assert ws.subprotocol == "ember.test"
        assert json.loads(ws.recv(timeout=30)) == {"hello": "private", "path": f"/{APP}--web/chat"}
        ws.send("hi")
        assert ws.recv(timeout=30) == "echo: hi"
        ws.send(b"\x00\x01\xff")
        assert ws.recv(timeout=30) == b"\xff\x01\x00"
        ws.send("close please")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4000, "asked to")


def test_a_caller_closing_the_websocket_reaches_the_app(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with _session(platform, "open-web", "chat") as ws:
        assert json.loads(ws.recv(timeout=30))["hello"] == "public"
        ws.close(code=4321)
    wait_for(
        lambda: (
            "closed by the caller with code 4321"
            in platform.ember("logs", f"{APP}/open-web").stdout
        ),
        30,
    )


def test_websocket_handshakes_that_fail_get_http_answers(
    platform: Platform, deployed: dict[str, str]
) -> None:
    context = client_context(platform.ca)
    with pytest.raises(InvalidStatus) as no_token:
        connect(_ws_url(platform, "web", "chat"), ssl=context, open_timeout=60)
    assert no_token.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as refused:
        connect(_ws_url(platform, "open-web", "chat?refuse=1"), ssl=context, open_timeout=60)
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as not_web:
        connect(
            platform.url.replace("https://", "wss://") + "/nothing--here/",
            ssl=context,
            open_timeout=60,
        )
    assert not_web.value.response.status_code == 404


def test_an_app_failing_mid_session_closes_it_with_1011(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with _session(platform, "open-web", "chat") as ws:
        ws.recv(timeout=30)
        ws.send("fail")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011


def test_a_wsgi_app_gets_pep_3333s_environ_and_streams_its_response(
    platform: Platform, deployed: dict[str, str]
) -> None:
    base = f"/{APP}--wsgi-web"
    with platform.client() as client:
        response = client.get(f"{base}/items/7", params={"q": "x"})
        assert response.status_code == 200, response.text
        assert response.headers["x-kind"] == "wsgi"
        assert response.json() == {
            "REQUEST_METHOD": "GET",
            "SCRIPT_NAME": base,
            "PATH_INFO": "/items/7",
            "QUERY_STRING": "q=x",
            "call": response.headers["x-ember-call-id"],
        }
        payload = bytes(range(256)) * 1024
        echoed = client.post(
            f"{base}/echo", content=payload, headers={"content-type": "application/x-test"}
        )
        assert (echoed.status_code, echoed.content) == (201, payload)
        assert echoed.headers["content-type"] == "application/x-test"
        with client.stream("GET", f"{base}/stream", params={"n": "4"}) as streamed:
            pieces = list(streamed.iter_raw())
        assert b"".join(pieces) == b"".join(f"line {i}\n".encode() for i in range(4))
        assert len(pieces) >= 2  # not buffered into one
        failed = client.get(f"{base}/fail")
        assert failed.status_code == 500
    # The replica prints the traceback as (or after) it answers: its output may still be
    # on its way.
    wait_for(lambda: "the wsgi view failed" in platform.ember("logs", f"{APP}/wsgi-web").stdout, 10)


def test_a_flask_app_routes_and_builds_its_urls_under_the_root_path(
    platform: Platform, deployed: dict[str, str]
) -> None:
    base = f"/{APP}--flask-web"
    with platform.client() as client:
        hello = client.get(f"{base}/hello/ada", params={"lang": "en"})
        assert hello.status_code == 200, hello.text
        assert hello.json() == {"hello": "ada", "lang": "en", "self": f"{base}/hello/ada"}
        upload = client.post(
            f"{base}/upload", content=b"x" * 70_000, headers={"content-type": "image/png"}
        )
        assert upload.json() == {"bytes": 70_000, "type": "image/png"}
        assert client.get(f"{base}/nowhere").status_code == 404  # Flask's own
