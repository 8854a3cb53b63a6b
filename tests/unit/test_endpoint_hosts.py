"""Requests on an endpoint's own host (`--domain`: https://APP--ENDPOINT.DOMAIN/), where
the path after the host is the endpoint's: what reaches the API there, and the advice of
a 404 that names a method the endpoint lacks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ember.declarations.settings import EndpointSettings
from ember.wire.labels import route_request
from ember.wire.spec import FUNCTION_METHOD, EndpointSpec, MethodSpec
from ember_platform.config import ServerConfig
from ember_platform.edge.errors import HttpError
from ember_platform.http.app import PlatformApp
from ember_platform.http.gateway import Gateway, resolve_method

DOMAIN = "ember.test"


def _runtime(kind: str, *methods: MethodSpec) -> Any:
    if kind == "function":
        methods = (MethodSpec(FUNCTION_METHOD, streaming=False, is_async=False),)
    spec = EndpointSpec(
        name="x",
        attribute="x",
        kind=kind,
        settings=EndpointSettings(),
        methods={m.name: m for m in methods},
    )
    return SimpleNamespace(spec=spec)  # all that routing and resolve_method read


ENDPOINTS = {
    "app--fn": _runtime("function"),
    "app--cls": _runtime(
        "class",
        MethodSpec("latest", streaming=False, is_async=False, path="v1/calls/latest"),
        MethodSpec("other", streaming=False, is_async=False),
    ),
    "app--web": _runtime("asgi", MethodSpec(FUNCTION_METHOD, streaming=False, is_async=False)),
}


taken: list[str] = []  # who took each request: "api" or "gateway"


class _Recording(Gateway):
    """The gateway's routing, with its requests recorded instead of served."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        taken.append("gateway")


async def _api(scope: dict[str, Any], receive: Any, send: Any) -> None:
    taken.append("api")


def _taker(tmp_path: Path, host: str, path: str, method: str = "GET") -> str:
    gateway = _Recording.__new__(_Recording)
    gateway.cluster = SimpleNamespace(endpoints=ENDPOINTS)  # type: ignore[assignment]
    gateway.config = ServerConfig(state_dir=tmp_path, domain=DOMAIN)
    app = PlatformApp.__new__(PlatformApp)
    app.api = _api  # type: ignore[assignment]
    app.gateway = gateway
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"host", host.encode())]}
    taken.clear()
    asyncio.run(app(scope, None, None))  # type: ignore[arg-type]
    (which,) = taken
    return which


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS"])
@pytest.mark.parametrize("label", ["app--fn", "app--cls", "app--gone"])
def test_a_spawned_calls_status_url_on_the_endpoints_host_reaches_the_calls_api(
    tmp_path: Path, method: str, label: str
) -> None:
    # The 202's Location, /v1/calls/{id}, is relative to the URL the call was made at.
    assert _taker(tmp_path, f"{label}.{DOMAIN}:9543", "/v1/calls/c-abc", method) == "api"


@pytest.mark.parametrize(
    ("host", "path", "taker"),
    [
        # The endpoint's own paths under /v1/ stay its own.
        (f"app--fn.{DOMAIN}", "/v1/chat/completions", "gateway"),
        (f"app--fn.{DOMAIN}", "/v1/calls", "gateway"),
        (f"app--fn.{DOMAIN}", "/v1/calls/c-abc/more", "gateway"),
        (f"app--cls.{DOMAIN}", "/v1/calls/latest", "gateway"),  # a method's path=
        (f"app--web.{DOMAIN}:9543", "/v1/calls/c-abc", "gateway"),  # a web app's every path
        # Path-style URLs: /v1/ is the API's, as before.
        ("127.0.0.1:9543", "/v1/calls/c-abc", "api"),
        (DOMAIN, "/v1/calls/c-abc", "api"),
        ("127.0.0.1:9543", "/app--fn/", "gateway"),
        # The dashboard's paths are the platform's, but on an endpoint's own host.
        ("127.0.0.1:9543", "/dashboard", "api"),
        ("127.0.0.1:9543", "/dashboard/login", "api"),
        (DOMAIN, "/dashboard/api/v1/apps", "api"),
        (f"app--web.{DOMAIN}", "/dashboard/login", "gateway"),
        ("127.0.0.1:9543", "/dashboards", "gateway"),  # no label either: the gateway's 404
    ],
)
def test_other_paths_go_where_they_went(tmp_path: Path, host: str, path: str, taker: str) -> None:
    assert _taker(tmp_path, host, path) == taker


def _not_found(label: str, host: str, path: str) -> str:
    route = route_request(host, path, DOMAIN)
    assert route is not None
    with pytest.raises(HttpError) as refused:
        resolve_method(ENDPOINTS[label], route)
    assert refused.value.status == 404
    message: str = refused.value.message
    return message


def test_a_function_endpoints_404_advises_the_path_of_the_host_called() -> None:
    assert _not_found("app--fn", f"app--fn.{DOMAIN}:9543", "/anything").endswith(
        "is a function endpoint; call it at /, not /anything"
    )
    assert _not_found("app--fn", "127.0.0.1:9543", "/app--fn/anything").endswith(
        "is a function endpoint; call it at /app--fn/, not /app--fn/anything"
    )


def test_a_class_endpoints_404_lists_its_methods_on_the_host_called() -> None:
    assert _not_found("app--cls", f"app--cls.{DOMAIN}", "/").endswith("call /latest, /other")
    assert _not_found("app--cls", "127.0.0.1:9543", "/app--cls").endswith(
        "call /app--cls/latest, /app--cls/other"
    )
