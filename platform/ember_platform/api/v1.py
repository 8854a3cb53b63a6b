"""The control plane's own API under /v1: each resource's handlers, assembled in one list
of routes (workspaces, deploys, canaries, apps, nodes, tokens, secrets, calls, logs,
usage, replicas, snapshots, dicts, queues, volumes), with the platform's health and
metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ember_platform.api.apps import AppsApi
from ember_platform.api.calls import CallsApi
from ember_platform.api.canaries import CanariesApi
from ember_platform.api.deploys import DeploysApi
from ember_platform.api.image_builds import ImageBuildsApi
from ember_platform.api.images import ImagesApi
from ember_platform.api.logs import LogsApi
from ember_platform.api.nodes import NodesApi
from ember_platform.api.replicas import ReplicasApi
from ember_platform.api.secrets import SecretsApi
from ember_platform.api.snapshots import SnapshotsApi
from ember_platform.api.state.shared_state import SharedStateApi
from ember_platform.api.state.volumes import VolumesApi
from ember_platform.api.tokens import TokensApi
from ember_platform.api.usage import UsageApi
from ember_platform.api.workspaces import Tenancy, WorkspacesApi
from ember_platform.core.cluster import Cluster
from ember_platform.core.cluster_status import update_gauges
from ember_platform.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.security.workspaces import WorkspaceRegistry
from ember_platform.storage.blobs import BlobStore


class Api:
    def __init__(
        self,
        cluster: Cluster,
        tokens: TokenRegistry,
        blobs: BlobStore,
        base_url: str,
        removing_workspace: Callable[[str], None] | None = None,  # e.g. its batches stop
    ) -> None:
        self.cluster = cluster
        self.tokens = tokens
        # Set once the control plane begins to stop: answers that wait (a log follow, a
        # call's ?wait=, a queue's get) end then, rather than hold the shutdown until it
        # cuts them off.
        self.stopping = asyncio.Event()
        self.tenancy = Tenancy(tokens, WorkspaceRegistry(cluster.store))
        self.workspaces = WorkspacesApi(self.tenancy, cluster, removing_workspace)
        self.shared_state = SharedStateApi(self.tenancy, cluster.store, self.stopping)
        self.volumes = VolumesApi(self.tenancy, cluster.store, blobs)
        self.replicas = ReplicasApi(self.tenancy, cluster)
        self.snapshots = SnapshotsApi(self.tenancy, cluster, blobs)
        self.deploys = DeploysApi(self.tenancy, cluster, blobs, base_url)
        self.canaries = CanariesApi(self.tenancy, cluster)
        self.apps = AppsApi(self.tenancy, cluster, base_url)
        self.nodes = NodesApi(tokens, cluster)
        self.token_api = TokensApi(self.tenancy)
        self.secrets = SecretsApi(self.tenancy, cluster)
        self.calls = CallsApi(self.tenancy, cluster, self.stopping)
        self.logs = LogsApi(self.tenancy, cluster, self.stopping)
        self.usage = UsageApi(self.tenancy, cluster)
        self.images = ImagesApi(tokens, blobs, on_drop=cluster.image_copies.forget)
        self.image_builds = ImageBuildsApi(
            self.tenancy, cluster.image_builds, blobs, cluster.secrets
        )

    def begin_stopping(self) -> None:
        """The control plane stops: waiting answers end, and so do `ember replica exec`
        commands (killed, their callers told why)."""
        self.stopping.set()
        self.cluster.execs.end_all("the control plane is stopping")

    def routes(self) -> list[BaseRoute]:
        deploys, canaries, apps, calls = self.deploys, self.canaries, self.apps, self.calls
        tokens, secrets = self.token_api, self.secrets
        return [
            *self.shared_state.routes(),
            *self.volumes.routes(),
            *self.replicas.routes(),
            *self.snapshots.routes(),
            *self.images.routes(),
            *self.image_builds.routes(),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/v1/webhooks/secret", calls.webhook_secret, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/bundles/{digest}", deploys.put_bundle, methods=["PUT"]),
            Route("/v1/bundles/{digest}", deploys.get_bundle, methods=["GET"]),
            Route("/v1/snapshots/{key}", self.snapshots.put_snapshot, methods=["PUT"]),
            Route("/v1/snapshots/{key}", self.snapshots.get_snapshot, methods=["GET"]),
            Route("/v1/apps", apps.list_apps, methods=["GET"]),
            Route("/v1/nodes/{name}/drain", self.nodes.drain_node, methods=["POST"]),
            Route("/v1/nodes/{name}/uncordon", self.nodes.uncordon_node, methods=["POST"]),
            Route(
                "/v1/nodes/{name}/gpus/{index}/uncordon",
                self.nodes.uncordon_gpu,
                methods=["POST"],
            ),
            Route("/v1/apps/{app}/deployments", deploys.deploy, methods=["POST"]),
            Route("/v1/apps/{app}/deployments", deploys.history, methods=["GET"]),
            Route("/v1/apps/{app}/rollback", deploys.rollback, methods=["POST"]),
            Route("/v1/apps/{app}/canary", canaries.canary, methods=["GET"]),
            Route("/v1/apps/{app}/canary", canaries.set_canary, methods=["PATCH"]),
            Route("/v1/apps/{app}/canary", canaries.withdraw_canary, methods=["DELETE"]),
            Route("/v1/apps/{app}/canary/promote", canaries.promote_canary, methods=["POST"]),
            Route("/v1/apps/{app}", apps.stop_app, methods=["DELETE"]),
            Route("/v1/apps/{app}/logs", self.logs.logs, methods=["GET"]),
            Route("/v1/endpoints/{label}", apps.endpoint_info, methods=["GET"]),
            Route("/v1/endpoints/{label}/scaling", apps.scaling, methods=["GET"]),
            Route("/v1/endpoints/{label}/scaling", apps.set_scaling, methods=["PATCH"]),
            Route("/v1/endpoints/{label}/scaling", apps.reset_scaling, methods=["DELETE"]),
            Route("/v1/workspaces", self.workspaces.list_workspaces, methods=["GET"]),
            Route("/v1/workspaces", self.workspaces.create_workspace, methods=["POST"]),
            Route("/v1/workspaces/{name}", self.workspaces.delete_workspace, methods=["DELETE"]),
            Route("/v1/workspaces/{name}/limits", self.workspaces.set_limits, methods=["PATCH"]),
            Route("/v1/tokens", tokens.create_token, methods=["POST"]),
            Route("/v1/tokens", tokens.list_tokens, methods=["GET"]),
            Route("/v1/tokens/{token_id}", tokens.revoke_token, methods=["DELETE"]),
            Route("/v1/calls", calls.list_calls, methods=["GET"]),
            Route("/v1/usage", self.usage.usage, methods=["GET"]),
            Route("/v1/calls/{call_id}", calls.cors.around(calls.get_call), methods=["GET"]),
            Route("/v1/calls/{call_id}", calls.cors.preflight, methods=["OPTIONS"]),
            Route("/v1/secrets", secrets.list_secrets, methods=["GET"]),
            Route("/v1/secrets/{name}", secrets.put_secret, methods=["PUT"]),
            Route("/v1/secrets/{name}", secrets.delete_secret, methods=["DELETE"]),
            Route("/v1/calls/{call_id}", calls.cors.around(calls.cancel_call), methods=["DELETE"]),
        ]

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "workers": len(self.cluster.workers)})

    async def metrics(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.METRICS)
        update_gauges(self.cluster)
        text = self.cluster.metrics.exposition() + self.cluster.engine_metrics.exposition()
        return Response(text, media_type=METRICS_CONTENT_TYPE)
