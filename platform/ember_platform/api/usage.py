"""Usage (`ember usage`): what each endpoint's replicas held over a past span: replica-,
CPU-, GiB- and GPU-seconds, starts by kind, inputs."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.endpoints.settings import check_name
from ember.errors import InvalidError
from ember_platform.core.cluster import Cluster
from ember_platform.http.errors import HttpError
from ember_platform.observability.usage import USAGE_RETENTION_SECONDS, summarize
from ember_platform.security.tokens import Scope, TokenRegistry


class UsageApi:
    def __init__(self, tokens: TokenRegistry, cluster: Cluster) -> None:
        self.tokens = tokens
        self.cluster = cluster

    async def usage(self, request: Request) -> Response:
        """Per endpoint, what its replicas held over the last `since` seconds (a day by
        default, at most the retention): replica-, CPU-, GiB- and GPU-seconds, starts
        by kind, inputs. Ended replicas come from the store, live ones up to now."""
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        app = request.query_params.get("app") or None
        try:
            since_seconds = float(request.query_params.get("since", "86400"))
            if app is not None:
                check_name("app", app)
        except (ValueError, InvalidError) as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        if not 0 < since_seconds <= USAGE_RETENTION_SECONDS:
            raise HttpError(
                400,
                "invalid_request",
                f"since must be 1 s to {USAGE_RETENTION_SECONDS // 86_400} days (in seconds)",
            )
        now = time.time()
        since = now - since_seconds
        records = self.cluster.store.usage_since(since)
        records += [self.cluster.usage_of(r, now) for r in self.cluster.replicas.values()]
        rows = [u.to_dict() for u in summarize(records, since, now)]
        if app is not None:
            rows = [row for row in rows if row["app"] == app]
        return JSONResponse({"since": since, "until": now, "endpoints": rows})
