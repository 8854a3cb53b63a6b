"""Browsers calling endpoints from other origins: preflights are answered without a
token, answers (errors and streams too) carry the headers that let the page read them,
and origins an endpoint does not list get none."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from harness import Platform

APP = "browser"
PAGE = "https://app.example.com"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "browser.py", APP)


def _preflight(platform: Platform, label: str, origin: str, **extra: str) -> httpx.Response:
    with platform.client() as client:
        return client.options(
            f"/{label}/",
            headers={
                "Authorization": "",  # browsers send no token in a preflight
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                **extra,
            },
        )


def test_a_listed_page_gets_its_preflight_and_answers(
    platform: Platform, deployed: dict[str, str]
) -> None:
    preflight = _preflight(
        platform,
        f"{APP}--shout",
        PAGE,
        **{"Access-Control-Request-Headers": "authorization, content-type"},
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert preflight.headers["access-control-allow-methods"] == "GET, POST"
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    with platform.client() as client:
        answer = client.post(f"/{APP}--shout/", json={"text": "hi"}, headers={"Origin": PAGE})
        assert answer.json() == "HI"
        assert answer.headers["access-control-allow-origin"] == PAGE
        assert "x-ember-call-id" in answer.headers["access-control-expose-headers"]
        # Errors too, so that the page can tell the user why.
        bad = client.post(f"/{APP}--shout/", json={"text": 1}, headers={"Origin": PAGE})
        assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == PAGE
        unauthorized = client.post(
            f"/{APP}--shout/", json={"text": "x"}, headers={"Origin": PAGE, "Authorization": ""}
        )
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == PAGE


def test_any_origin_may_read_a_public_stream(platform: Platform, deployed: dict[str, str]) -> None:
    origin = "http://localhost:3000"
    assert _preflight(platform, f"{APP}--count", origin).status_code == 204
    with platform.client() as client:
        answer = client.get(f"/{APP}--count/", params={"to": "2"}, headers={"Origin": origin})
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.headers["access-control-allow-origin"] == origin
        assert answer.text.count("data:") == 2


def test_other_origins_and_endpoints_get_no_cors_headers(
    platform: Platform, deployed: dict[str, str]
) -> None:
    for label, origin in ((f"{APP}--shout", "https://evil.example"), (f"{APP}--closed", PAGE)):
        refused = _preflight(platform, label, origin)
        assert refused.status_code == 403 and "does not list that origin" in refused.text
        assert "access-control-allow-origin" not in refused.headers
        with platform.client() as client:
            answer = client.post(f"/{label}/", json={"text": "x"}, headers={"Origin": origin})
            assert answer.status_code == 200
            assert "access-control-allow-origin" not in answer.headers


def test_a_private_web_apps_preflight_reaches_its_own_cors_middleware(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--private-site"
    with platform.client() as client:
        preflight = client.options(
            f"/{label}/hello",
            headers={
                "Authorization": "",  # as a browser sends it: no token
                "Origin": PAGE,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == PAGE
        # Its other requests still need the token.
        anonymous = client.post(f"/{label}/hello", headers={"Authorization": "", "Origin": PAGE})
        assert anonymous.status_code == 401
        answer = client.post(f"/{label}/hello", headers={"Origin": PAGE})
        assert answer.text == "hello" and answer.headers["access-control-allow-origin"] == PAGE


def test_a_page_reads_and_cancels_the_calls_it_spawned(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        spawned = client.post(
            f"/{APP}--shout/",
            json={"text": "later"},
            headers={"Origin": PAGE, "Prefer": "respond-async"},
        )
        assert spawned.status_code == 202 and spawned.headers["access-control-allow-origin"] == PAGE
        status_url = spawned.json()["status_url"]
        asked = {
            "Authorization": "",
            "Origin": PAGE,
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization",
        }
        preflight = client.options(status_url, headers=asked)
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == PAGE
        assert preflight.headers["access-control-allow-methods"] == "GET, DELETE"
        answer = client.get(status_url, params={"wait": "30"}, headers={"Origin": PAGE})
        assert answer.json() == "LATER" and answer.headers["access-control-allow-origin"] == PAGE
        # An error the page may read too: cancelling a finished call.
        late = client.delete(status_url, headers={"Origin": PAGE})
        assert late.status_code == 409 and late.headers["access-control-allow-origin"] == PAGE
        # Another origin is told no, and gets no headers to read with.
        other = client.options(status_url, headers={**asked, "Origin": "https://evil.example"})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
        plain = client.get(status_url, headers={"Origin": "https://evil.example"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_a_page_reads_and_cancels_its_spawned_call_on_the_endpoints_own_host(
    platform: Platform, deployed: dict[str, str]
) -> None:
    # The 202's status_url is relative to the URL called; on https://LABEL.DOMAIN/ it
    # must reach the calls API, not the endpoint as a method named "v1/calls/...".
    endpoint_url = deployed[f"{APP}--shout"]
    host = urlsplit(endpoint_url).netloc
    assert host.startswith(f"{APP}--shout.ember.localhost:")
    on_host = {"Host": host}  # connected to the platform's address, as DNS would
    with platform.client() as client:
        spawned = client.post(
            "/",
            json={"text": "there"},
            headers={**on_host, "Origin": PAGE, "Prefer": "respond-async"},
        )
        assert spawned.status_code == 202, spawned.text
        assert spawned.headers["location"] == spawned.json()["status_url"]
        status_url = urljoin(endpoint_url, spawned.json()["status_url"])
        assert urlsplit(status_url).netloc == host
        path = urlsplit(status_url).path
        preflight = client.options(
            path,
            headers={
                **on_host,
                "Authorization": "",
                "Origin": PAGE,
                "Access-Control-Request-Method": "DELETE",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == PAGE
        answer = client.get(path, params={"wait": "30"}, headers={**on_host, "Origin": PAGE})
        assert answer.status_code == 200, answer.text
        assert answer.json() == "THERE" and answer.headers["access-control-allow-origin"] == PAGE
        late = client.delete(path, headers={**on_host, "Origin": PAGE})
        assert late.status_code == 409, late.text  # the calls API's: the call had finished
        assert late.headers["access-control-allow-origin"] == PAGE
