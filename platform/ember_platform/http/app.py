"""Composes the ASGI application: /v1 API and channels, everything else to the gateway."""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from ember_platform.api.v1 import Api
from ember_platform.edge.asgi_types import Receive, Send
from ember_platform.edge.errors import HttpError, error_body, http_error
from ember_platform.errors import PlatformError
from ember_platform.http.channels import Channels
from ember_platform.http.dashboard import Dashboard, is_dashboard_path
from ember_platform.http.gateway import Gateway
from ember_platform.observability.history import MetricsHistory
from ember_platform.storage.s3_blobs import BlobStoreError
from ember_platform.storage.state_store import StoreUnavailableError, StoreWriteError

log = logging.getLogger("ember.api")


DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


async def _http_error(request: Request, error: Exception) -> Response:
    """An `HttpError`, or one of the platform's own errors with its status."""
    if not isinstance(error, HttpError | PlatformError):
        raise error
    exc = http_error(error)
    return Response(exc.body(), exc.status, exc.headers, media_type="application/json")


# Error types of Starlette's own answers, as the API's handlers name them.
HTTP_ERROR_TYPES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


async def _starlette_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such path, a method the path does not take, a form it
    cannot parse) in the platform's error format, not its plain text."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"{where}: no such path in the API"
    elif exc.status_code == 405:
        # Starlette's Allow names the methods of one route only; a path may have several.
        allowed = ", ".join(_methods_of(request))
        headers["Allow"] = allowed
        message = f"{where}: this path takes {allowed}"
    else:
        message = f"{where}: {exc.detail}"
    error_type = HTTP_ERROR_TYPES.get(exc.status_code) or _snake_case(exc.status_code)
    body = error_body(error_type, message)
    return Response(body, exc.status_code, headers, media_type="application/json")


def _methods_of(request: Request) -> list[str]:
    """Every method some route of the request's path takes."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods:
            match, _ = route.matches(request.scope)
            if match != Match.NONE:
                methods |= route.methods
    return sorted(methods)


def _snake_case(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "http_error"


async def _storage_error(request: Request, exc: Exception) -> Response:
    """The state store or the blob store refused a write (the API writes before it
    changes anything live): 507, and the caller may retry once there is room."""
    if isinstance(exc, OSError) and exc.errno not in DISK_FULL:
        raise exc
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    log.warning("%s %s refused: %s", request.method, request.url.path, reason)
    message = (
        f"the control plane could not store this ({reason}); nothing was changed: "
        "retry once the disk of its state dir has room"
    )
    return Response(error_body("insufficient_storage", message), 507, media_type="application/json")


def _unavailable(error_type: str) -> Callable[[Request, Exception], Awaitable[Response]]:
    """A handler of a backing store's failure: 503 naming it, to try again in a moment."""

    async def answer(request: Request, exc: Exception) -> Response:
        log.warning("%s %s failed: %s", request.method, request.url.path, exc)
        message = f"{exc}; try again once it answers"
        body = error_body(error_type, message)
        return Response(body, 503, {"Retry-After": "5"}, media_type="application/json")

    return answer


# The blob store failed under a request.
_blob_store_error = _unavailable("blob_store_unavailable")
# The state store's database is out of reach (PostgreSQL restarting); it is reached again
# at a later request once it answers.
_state_store_unavailable = _unavailable("state_store_unavailable")


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Any other failure still answers in the platform's error format (Starlette then
    logs the traceback)."""
    message = f"the control plane failed: {type(exc).__name__}: {exc}; see the server's log"
    return Response(error_body("internal_error", message), 500, media_type="application/json")


METRICS_PATH = "/metrics"  # where Prometheus looks by default


class PlatformApp:
    """Routes /v1/*, /metrics and /dashboard to the API (Starlette), every other request
    to the gateway; on an endpoint's own host (`--domain`) its paths are the endpoint's,
    but for the status URLs of spawned calls."""

    def __init__(
        self,
        api: Api,
        channels: Channels,
        gateway: Gateway,
        history: MetricsHistory | None = None,
    ) -> None:
        routes: list[Any] = api.routes()
        self.dashboard = Dashboard(api.tenancy, history or MetricsHistory(), api.cluster.store)
        routes += self.dashboard.routes()
        routes += channels.routes()
        self.api = Starlette(
            routes=routes,
            exception_handlers={
                HttpError: _http_error,
                PlatformError: _http_error,
                HTTPException: _starlette_error,
                StoreUnavailableError: _state_store_unavailable,
                StoreWriteError: _storage_error,
                BlobStoreError: _blob_store_error,
                OSError: _storage_error,
                Exception: _internal_error,
            },
        )
        self.gateway = gateway

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == METRICS_PATH or is_dashboard_path(path)):
            # No endpoint label lacks "--", so this path is never an endpoint's.
            await (self.gateway if self.gateway.route(scope) else self.api)(scope, receive, send)
        elif scope["type"] in ("http", "websocket") and not scope["path"].startswith("/v1/"):
            await self.gateway(scope, receive, send)  # WebSockets: a web app's sessions
        elif scope["type"] == "http" and self.gateway.owns_v1_path(scope):
            # A wildcard-domain host whose method happens to be called "v1" (its spawned
            # calls' /v1/calls/{id} is the API's).
            await self.gateway(scope, receive, send)
        else:
            await self.api(scope, receive, send)
