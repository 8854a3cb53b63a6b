"""Usage (`ember usage`): what each endpoint's replicas held over a past span: replica-,
CPU-, GiB- and GPU-seconds, starts by kind, inputs."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.wire.labels import split_app_key
from ember_platform.api.workspaces import Tenancy, in_listing
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.observability.usage import USAGE_RETENTION_SECONDS, summarize


class UsageApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster) -> None:
        self.tenancy = tenancy
        self.cluster = cluster

    async def usage(self, request: Request) -> Response:
        """Per endpoint, what its replicas held over the last `since` seconds (a day by
        default, at most the retention): replica-, CPU-, GiB- and GPU-seconds, starts
        by kind, inputs, for the endpoints of the request's workspace (every one's for
        an admin's `?all_workspaces=true`). Ended replicas come from the store, live
        ones up to now."""
        _, workspace = self.tenancy.listed(request)
        named = request.query_params.get("app") or None
        app = None if named is None else self.tenancy.app(request, named)
        try:
            since_seconds = float(request.query_params.get("since", "86400"))
        except ValueError as exc:
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
        records += [
            self.cluster.replica_lifecycle.usage_of(r, now) for r in self.cluster.replicas.values()
        ]
        tokens = self.cluster.store.token_usage_since(since)
        prices = self.cluster.config.prices
        rows = []
        for summary in summarize(records, since, now, tokens):
            if (app is not None and summary.app != app) or not in_listing(summary.app, workspace):
                continue
            row = summary.to_dict()
            if prices.set:
                row |= summary.priced(prices)
            row["workspace"], row["app"] = split_app_key(summary.app)
            rows.append(row)
        priced = prices.describe() if prices.set else None
        return JSONResponse({"since": since, "until": now, "prices": priced, "endpoints": rows})
