"""An app's canary (`ember canary`): a new version taking a share of the calls beside
the serving one; its calls, errors and latency against the serving version's, a new
share, and its end: promoted to serve every call, or withdrawn."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidError
from ember_platform.api.workspaces import Tenancy
from ember_platform.core.canaries import check_canary_percent
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.runtime.cluster_model import EndpointRuntime


class CanariesApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster) -> None:
        self.tenancy = tenancy
        self.cluster = cluster

    def _canaries_of(self, request: Request) -> tuple[str, list[EndpointRuntime]]:
        app = self.tenancy.app(request, request.path_params["app"])
        canaries = [c for c in self.cluster.canaries.values() if c.app == app]
        if not canaries:
            raise HttpError(
                404, "not_found", f"{app} has no canary (`ember deploy --canary 10` starts one)"
            )
        return app, canaries

    def _canary_answer(self, app: str, canaries: list[EndpointRuntime]) -> JSONResponse:
        endpoints = []
        for canary in sorted(canaries, key=lambda c: c.label):
            serving = self.cluster.endpoints[canary.label]
            endpoints.append(
                {
                    "label": canary.label,
                    "canary": {"version": canary.version, **canary.outcomes.summary()},
                    "serving": {"version": serving.version, **serving.outcomes.summary()},
                }
            )
        return JSONResponse(
            {
                "app": app,
                "version": canaries[0].version,
                "percent": canaries[0].canary_percent,
                "endpoints": endpoints,
            }
        )

    async def canary(self, request: Request) -> Response:
        """The app's canary: its share, and each endpoint's calls, errors and latency in
        the canary and in the serving version since the canary began."""
        app, canaries = self._canaries_of(request)
        return self._canary_answer(app, canaries)

    async def set_canary(self, request: Request) -> Response:
        app, canaries = self._canaries_of(request)
        try:
            payload = await request.json()
            percent = check_canary_percent(payload.get("percent"))
        except json.JSONDecodeError:
            raise HttpError(400, "invalid_json", "the body is not valid JSON") from None
        except AttributeError:
            raise HttpError(400, "invalid_request", 'send {"percent": 25}') from None
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        self.cluster.store.set_canary_percent(app, canaries[0].version, percent)
        self.cluster.trials.set_percent(app, percent)
        return self._canary_answer(app, canaries)

    async def promote_canary(self, request: Request) -> Response:
        """The canary serves every call from now on; the old version's replicas retire."""
        app, canaries = self._canaries_of(request)
        version = canaries[0].version
        self.cluster.store.set_canary_percent(app, version, None)
        for canary in canaries:
            self.cluster.trials.promote(canary.label)
        self.cluster.collect_garbage()
        return JSONResponse({"app": app, "version": version, "promoted": True})

    async def withdraw_canary(self, request: Request) -> Response:
        """End the canary: every call goes to the serving version again."""
        app, canaries = self._canaries_of(request)
        version = canaries[0].version
        self.cluster.store.withdraw_deployment(app, version)
        for canary in canaries:
            self.cluster.trials.withdraw(canary.label, "withdrawn by `ember canary --abort`")
        self.cluster.collect_garbage()
        return JSONResponse({"app": app, "version": version, "withdrawn": True})
