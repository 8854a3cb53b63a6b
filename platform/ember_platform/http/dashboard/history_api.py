"""`GET /v1/dashboard/history`: the last hour of each endpoint of the request's workspace,
as the control plane sampled it (`observability/history.py`): `?since=` (a Unix time)
for the points after it only, `?label=` for one endpoint."""

from __future__ import annotations

import math
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.wire.labels import split_label
from ember_platform.api.workspaces import Tenancy, in_workspace
from ember_platform.errors import InvalidRequest
from ember_platform.observability.history import MetricsHistory
from ember_platform.security.tokens import Scope


class HistoryApi:
    def __init__(self, tenancy: Tenancy, history: MetricsHistory) -> None:
        self.tenancy = tenancy
        self.history = history

    async def history_of(self, request: Request) -> Response:
        _, workspace = self.tenancy.workspace(request, Scope.DEPLOY)
        try:
            since = float(request.query_params.get("since", "0"))
        except ValueError:
            raise InvalidRequest("since must be a Unix time") from None
        if not math.isfinite(since):
            raise InvalidRequest("since must be a Unix time")
        wanted = request.query_params.get("label")
        endpoints = {}
        for label in self.history.labels():
            parts = split_label(label)
            mine = parts is not None and in_workspace(parts[0], workspace)
            if not mine or (wanted and label != wanted):
                continue
            endpoints[label] = self.history.of(label, since)
        return JSONResponse(
            {
                "workspace": workspace,
                "now": time.time(),
                "interval": self.history.interval,
                "window": self.history.window,
                "endpoints": endpoints,
            }
        )
