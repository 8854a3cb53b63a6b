"""CORS for the spawned calls of endpoints that list origins (`cors_origins=`): a page
that spawned a call (its answer names the `status_url`) may read it and cancel it, with
the same origins as the endpoint's. A call's endpoint is known from its id."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from ember_platform.core.cluster import Cluster
from ember_platform.edge.cors import allowed_origin, answer_headers, is_preflight, preflight_headers
from ember_platform.edge.errors import HttpError, http_error
from ember_platform.errors import PlatformError

CALL_METHODS = b"GET, DELETE"
Handler = Callable[[Request], Awaitable[Response]]


class CallCors:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def origin(self, request: Request) -> bytes | None:
        """The request's Origin when the call's endpoint lists it, else None."""
        call_id = request.path_params["call_id"]
        live = self.cluster.inputs.get(call_id)
        record = None if live is not None else self.cluster.calls.get(call_id)
        label = live.label if live is not None else record.label if record is not None else ""
        runtime = self.cluster.endpoints.get(label)
        if runtime is None:
            return None
        return allowed_origin(runtime.settings.cors_origins, dict(request.headers.raw))

    async def preflight(self, request: Request) -> Response:
        """A browser asks, without a token, whether the page may read or cancel the call."""
        headers = dict(request.headers.raw)
        origin = self.origin(request)
        if origin is None or not is_preflight(request.method, headers):
            raise HttpError(
                403,
                "origin_not_allowed",
                "this call's endpoint lists no such origin in its cors_origins",
            )
        fields = preflight_headers(origin, headers, CALL_METHODS)
        return Response(
            status_code=204, headers={k.decode(): v.decode("latin-1") for k, v in fields}
        )

    def around(self, handler: Handler) -> Handler:
        """`handler` whose answers, errors included, a listed page may read."""

        async def handle(request: Request) -> Response:
            origin = self.origin(request)
            if origin is None:
                return await handler(request)
            try:
                response = await handler(request)
            except (HttpError, PlatformError) as error:
                exc = http_error(error)
                body = exc.body()
                response = Response(body, exc.status, exc.headers, media_type="application/json")
            for key, value in answer_headers(origin):
                response.headers.append(key.decode(), value.decode("latin-1"))
            return response

        return handle
