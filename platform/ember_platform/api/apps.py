"""Apps and their endpoints as they run (`ember ls | stop | scale`): every endpoint with
its URLs and the nodes beside them, stopping an app, what one endpoint takes, and its
autoscaling settings changed until the next deploy."""

from __future__ import annotations

import json

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidError
from ember.wire.labels import endpoint_urls, label_names, nearest_label, split_app_key
from ember_platform.api.calls import require_call_of
from ember_platform.api.workspaces import Tenancy, in_listing, in_workspace
from ember_platform.core.cluster import Cluster
from ember_platform.core.cluster_status import endpoint_rows
from ember_platform.edge.errors import HttpError
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.scaling.overrides import SCALABLE, parse_override
from ember_platform.security.tokens import Scope


class AppsApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster, base_url: str) -> None:
        self.tenancy = tenancy
        self.tokens = tenancy.tokens
        self.cluster = cluster
        self.base_url = base_url

    async def list_apps(self, request: Request) -> Response:
        """The endpoints of the request's workspace (every one's for an admin's
        `?all_workspaces=true`, the answer's workspace null then); the nodes, for an
        admin only."""
        grant, workspace = self.tenancy.listed(request)
        rows = [row for row in endpoint_rows(self.cluster) if in_listing(row["app"], workspace)]
        for row in rows:
            row["workspace"], row["app"] = split_app_key(row["app"])
            row["urls"] = endpoint_urls(row["label"], self.base_url, self.cluster.config.domain)
        if grant.scope is not Scope.ADMIN:
            return JSONResponse({"workspace": workspace, "endpoints": rows, "workers": []})
        on_node = self.cluster.state.replicas_by_worker()
        workers = [
            {
                "id": w.id,
                "name": w.name,
                "cpu": w.cpu,
                "memory": w.memory,
                "gpus": w.gpus,
                "gpu_health": [msgspec.structs.asdict(gpu) for gpu in w.gpu_health],
                "snapshots": w.snapshots,
                "memory_limits_problem": w.memory_limits_problem,
                "cpu_limits_problem": w.cpu_limits_problem,
                "channel": w.channel,
                "labels": w.labels,
                "draining": self.cluster.state.takes_no_replicas(w),
                "replicas": on_node.get(w.id, 0),
                # What its caches hold, as its heartbeats say (the scheduler prefers it).
                "weights_cached_bytes": sum(w.cached_weights.values()),
                "snapshots_cached": len(w.cached_snapshots),
            }
            for w in self.cluster.workers.values()
        ]
        return JSONResponse({"workspace": workspace, "endpoints": rows, "workers": workers})

    async def stop_app(self, request: Request) -> Response:
        app = self.tenancy.app(request, request.path_params["app"])
        stored = self.cluster.store.delete_app(app)
        count = self.cluster.deployments.remove_app(app)
        self.cluster.collect_garbage()
        if not stored and not count:
            raise HttpError(404, "not_found", f"no app named {request.path_params['app']}")
        return JSONResponse({"app": app, "stopped_endpoints": count})

    async def endpoint_info(self, request: Request) -> Response:
        label = self.tenancy.label(request, request.path_params["label"], Scope.INVOKE)
        require_call_of(self.tokens, request, label, f"no endpoint named {label}")
        runtime = self.cluster.endpoints.get(label)
        if runtime is None:
            raise self._unknown(request, label, Scope.INVOKE)
        return JSONResponse(
            {
                "label": label,
                "kind": runtime.spec.kind,
                "methods": [m.to_dict() for m in runtime.spec.methods.values()],
                "urls": endpoint_urls(label, self.base_url, self.cluster.config.domain),
            }
        )

    def _scaled_runtime(self, request: Request) -> EndpointRuntime:
        label = self.tenancy.label(request, request.path_params["label"])
        runtime = self.cluster.endpoints.get(label)
        if runtime is None:
            raise self._unknown(request, label, Scope.DEPLOY)
        return runtime

    def _unknown(self, request: Request, label: str, needed: Scope) -> HttpError:
        """The 404 for a label no endpoint has, naming the nearest one of its workspace
        that the token may reach, if one is close (`app--echos`: `app--echo`)."""
        grant = self.tenancy.grant(request, needed)
        names = label_names(label)  # the label is Tenancy.label's, so well-formed
        workspace = names[0] if names is not None else ""
        near = nearest_label(
            label,
            (
                other
                for other, runtime in self.cluster.endpoints.items()
                if grant.may_call(runtime.app) and in_workspace(runtime.app, workspace)
            ),
        )
        hint = f"; did you mean {near}?" if near else " (`ember ls` lists them)"
        return HttpError(404, "not_found", f"no endpoint named {label}{hint}")

    @staticmethod
    def _scaling_answer(runtime: EndpointRuntime) -> JSONResponse:
        return JSONResponse(
            {
                "label": runtime.label,
                "version": runtime.version,
                "override": runtime.scaling_override,
                "settings": {name: getattr(runtime.settings, name) for name in SCALABLE},
                "deployed": {name: getattr(runtime.spec.settings, name) for name in SCALABLE},
            }
        )

    async def scaling(self, request: Request) -> Response:
        """An endpoint's autoscaling settings: as deployed, the override, the result."""
        return self._scaling_answer(self._scaled_runtime(request))

    async def set_scaling(self, request: Request) -> Response:
        """Change autoscaling settings until the next deploy (JSON merge patch: a
        setting given as null goes back to its deployed value)."""
        runtime = self._scaled_runtime(request)
        try:
            change = parse_override(await request.json())
            self.cluster.deployments.set_scaling(runtime, change)
        except json.JSONDecodeError:
            raise HttpError(400, "invalid_json", "the body is not valid JSON") from None
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        return self._scaling_answer(runtime)

    async def reset_scaling(self, request: Request) -> Response:
        """Drop the override: the deployed settings hold again."""
        runtime = self._scaled_runtime(request)
        self.cluster.deployments.set_scaling(runtime, dict.fromkeys(runtime.scaling_override))
        return self._scaling_answer(runtime)
