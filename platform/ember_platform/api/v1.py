"""The control plane's own API under /v1: deploy, list, stop, logs, tokens, calls."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ember.endpoints.settings import check_name
from ember.errors import InvalidError
from ember.wire.blob_downloads import DIRECT_HEADER
from ember.wire.labels import endpoint_urls, make_label, split_label
from ember.wire.spec import AppManifest
from ember_platform.api.replicas import ReplicasApi
from ember_platform.api.shared_state import SharedStateApi
from ember_platform.api.snapshots import SnapshotsApi
from ember_platform.api.volumes import VolumesApi
from ember_platform.core.canaries import (
    apply_canary,
    check_canary_percent,
    promote_canary,
    set_canary_percent,
    withdraw_canary,
)
from ember_platform.core.cluster import Cluster
from ember_platform.core.cluster_model import EndpointRuntime
from ember_platform.core.cluster_status import endpoint_rows, update_gauges
from ember_platform.core.inputs import JSON_MEDIA_TYPE, Input, Outcome
from ember_platform.core.scaling_overrides import SCALABLE, parse_override
from ember_platform.http.call_cors import CallCors
from ember_platform.http.errors import HttpError
from ember_platform.observability.logs import LogFilter
from ember_platform.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ember_platform.observability.usage import USAGE_RETENTION_SECONDS, summarize
from ember_platform.security.rate_limits import parse_rate_limit
from ember_platform.security.tokens import (
    Grant,
    LastAdminTokenError,
    NoSuchTokenError,
    Scope,
    TokenRegistry,
    bearer_hash,
    checked_token_name,
    hash_token,
    token_id,
)
from ember_platform.snapshots.lifecycle import SNAPSHOT_KEY, blob_key
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.records import CallRecord, Deployment

MAX_BUNDLE_BYTES = 256 * 1024 * 1024
MAX_CALL_WAIT = 60.0
MAX_CALLS_LISTED = 1000
MAX_SNAPSHOT_BYTES = 64 * 1024**3
MAX_TOKEN_LIFETIME_S = 10 * 365 * 86_400.0  # the longest expires_in a token may have


def bundle_key(digest: str) -> str:
    return "bundles/" + digest.replace(":", "-")


class Api:
    def __init__(
        self, cluster: Cluster, tokens: TokenRegistry, blobs: BlobStore, base_url: str
    ) -> None:
        self.cluster = cluster
        self.tokens = tokens
        self.blobs = blobs
        self.base_url = base_url
        # Set once the control plane begins to stop: answers that wait (a log follow, a
        # call's ?wait=, a queue's get) end then, rather than hold the shutdown until it
        # cuts them off.
        self.stopping = asyncio.Event()
        self.shared_state = SharedStateApi(tokens, cluster.store, self.stopping)
        self.volumes = VolumesApi(tokens, cluster.store, blobs)
        self.replicas = ReplicasApi(tokens, cluster)
        self.snapshots = SnapshotsApi(tokens, cluster)
        self.call_cors = CallCors(cluster)

    def begin_stopping(self) -> None:
        """The control plane stops: waiting answers end, and so do `ember replica exec`
        commands (killed, their callers told why)."""
        self.stopping.set()
        self.cluster.execs.end_all("the control plane is stopping")

    def routes(self) -> list[BaseRoute]:
        return [
            *self.shared_state.routes(),
            *self.volumes.routes(),
            *self.replicas.routes(),
            *self.snapshots.routes(),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/v1/webhooks/secret", self.webhook_secret, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/bundles/{digest}", self.put_bundle, methods=["PUT"]),
            Route("/v1/bundles/{digest}", self.get_bundle, methods=["GET"]),
            Route("/v1/snapshots/{key}", self.put_snapshot, methods=["PUT"]),
            Route("/v1/snapshots/{key}", self.get_snapshot, methods=["GET"]),
            Route("/v1/apps", self.list_apps, methods=["GET"]),
            Route("/v1/nodes/{name}/drain", self.drain_node, methods=["POST"]),
            Route("/v1/nodes/{name}/uncordon", self.uncordon_node, methods=["POST"]),
            Route("/v1/apps/{app}/deployments", self.deploy, methods=["POST"]),
            Route("/v1/apps/{app}/deployments", self.history, methods=["GET"]),
            Route("/v1/apps/{app}/rollback", self.rollback, methods=["POST"]),
            Route("/v1/apps/{app}/canary", self.canary, methods=["GET"]),
            Route("/v1/apps/{app}/canary", self.set_canary, methods=["PATCH"]),
            Route("/v1/apps/{app}/canary", self.withdraw_canary, methods=["DELETE"]),
            Route("/v1/apps/{app}/canary/promote", self.promote_canary, methods=["POST"]),
            Route("/v1/apps/{app}", self.stop_app, methods=["DELETE"]),
            Route("/v1/apps/{app}/logs", self.logs, methods=["GET"]),
            Route("/v1/endpoints/{label}", self.endpoint_info, methods=["GET"]),
            Route("/v1/endpoints/{label}/scaling", self.scaling, methods=["GET"]),
            Route("/v1/endpoints/{label}/scaling", self.set_scaling, methods=["PATCH"]),
            Route("/v1/endpoints/{label}/scaling", self.reset_scaling, methods=["DELETE"]),
            Route("/v1/tokens", self.create_token, methods=["POST"]),
            Route("/v1/tokens", self.list_tokens, methods=["GET"]),
            Route("/v1/tokens/{token_id}", self.revoke_token, methods=["DELETE"]),
            Route("/v1/calls", self.list_calls, methods=["GET"]),
            Route("/v1/usage", self.usage, methods=["GET"]),
            Route("/v1/calls/{call_id}", self.call_cors.around(self.get_call), methods=["GET"]),
            Route("/v1/calls/{call_id}", self.call_cors.preflight, methods=["OPTIONS"]),
            Route("/v1/secrets", self.list_secrets, methods=["GET"]),
            Route("/v1/secrets/{name}", self.put_secret, methods=["PUT"]),
            Route("/v1/secrets/{name}", self.delete_secret, methods=["DELETE"]),
            Route(
                "/v1/calls/{call_id}", self.call_cors.around(self.cancel_call), methods=["DELETE"]
            ),
        ]

    def require(self, request: Request, needed: Scope) -> Grant:
        return self.tokens.require(request.headers.get("authorization"), needed)

    def require_call_of(self, request: Request, label: str, not_found: str) -> None:
        """An invoke token may reach `label`'s endpoint and calls; a token for another
        app is told `not_found`, as if there were nothing (it may not know of other apps)."""
        grant = self.require(request, Scope.INVOKE)
        parts = split_label(label)
        if parts is None or not grant.may_call(parts[0]):
            raise HttpError(404, "not_found", not_found)

    async def webhook_secret(self, request: Request) -> Response:
        """The key webhook receivers check signatures with (`ember.verify_webhook`)."""
        self.require(request, Scope.ADMIN)
        if self.cluster.webhooks is None:
            raise HttpError(404, "not_found", "this control plane sends no webhooks")
        return JSONResponse({"secret": self.cluster.webhooks.secret})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "workers": len(self.cluster.workers)})

    async def metrics(self, request: Request) -> Response:
        self.require(request, Scope.METRICS)
        update_gauges(self.cluster)
        return Response(self.cluster.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def put_bundle(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        digest = request.path_params["digest"]
        if not digest.startswith("sha256:") or len(digest) != 71:
            raise HttpError(400, "invalid_request", "bundle digests look like sha256:<64 hex>")
        data = bytearray()
        async for chunk in request.stream():
            data.extend(chunk)
            if len(data) > MAX_BUNDLE_BYTES:
                raise HttpError(
                    413, "payload_too_large", f"bundles are limited to {MAX_BUNDLE_BYTES} bytes"
                )
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise HttpError(
                400, "invalid_request", "the bundle's content does not match its digest"
            )
        await asyncio.to_thread(self.blobs.put, bundle_key(digest), bytes(data))
        return JSONResponse({"digest": digest, "size": len(data)}, status_code=201)

    async def get_bundle(self, request: Request) -> Response:
        self.require(request, Scope.WORKER)
        data = await asyncio.to_thread(self.blobs.get, bundle_key(request.path_params["digest"]))
        if data is None:
            raise HttpError(404, "not_found", "no such bundle")
        return Response(data, media_type="application/gzip")

    async def put_snapshot(self, request: Request) -> Response:
        self.require(request, Scope.WORKER)
        key = request.path_params["key"]
        if not SNAPSHOT_KEY.match(key):
            raise HttpError(400, "invalid_request", "snapshot keys are 32 hex digits")
        try:
            size = await self.blobs.put_chunks(blob_key(key), request.stream(), MAX_SNAPSHOT_BYTES)
        except ValueError as exc:
            raise HttpError(413, "payload_too_large", str(exc)) from None
        return JSONResponse({"key": key, "size": size}, status_code=201)

    async def get_snapshot(self, request: Request) -> Response:
        self.require(request, Scope.WORKER)
        key = request.path_params["key"]
        if not SNAPSHOT_KEY.match(key):
            raise HttpError(404, "not_found", f"no snapshot {key}")
        if request.headers.get(DIRECT_HEADER) == "1":
            # The worker can fetch from the blob store itself: the image's bytes need not
            # pass through this server (a missing image is the bucket's 404 then).
            direct = await asyncio.to_thread(self.blobs.direct_url, blob_key(key))
            if direct is not None:
                return Response(status_code=307, headers={"Location": direct})
        handle = await asyncio.to_thread(self.blobs.open, blob_key(key))
        if handle is None:
            raise HttpError(404, "not_found", f"no snapshot {key}")

        async def chunks() -> AsyncIterator[bytes]:
            with handle:
                while chunk := await asyncio.to_thread(handle.read, 4 * 1024 * 1024):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/zstd")

    async def deploy(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        app = request.path_params["app"]
        try:
            payload = await request.json()
            check_name("app", app)
            manifest = AppManifest.from_dict({**payload["manifest"], "app": app})
            for spec in manifest.endpoints:
                check_name("endpoint", spec.name)
            digest = str(payload["bundle_digest"])
            canary = payload.get("canary_percent")
            if canary is not None:
                check_canary_percent(canary)
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        except (ValueError, KeyError, TypeError) as exc:
            raise HttpError(400, "invalid_request", f"malformed deployment: {exc!r}") from None
        if not manifest.endpoints:
            raise HttpError(400, "invalid_request", "the app defines no @ember.endpoint")
        if canary is not None:
            self._check_canary(app, manifest)
        return await self._deploy(app, manifest, digest, canary_percent=canary)

    def _check_canary(self, app: str, manifest: AppManifest) -> None:
        """A canary is tried beside a serving version with the same endpoints, each of
        the same kind: every call has somewhere to go in both."""
        serving = {
            r.spec.name: r.spec.kind for r in self.cluster.endpoints.values() if r.app == app
        }
        if not serving:
            raise HttpError(
                409,
                "conflict",
                f"{app} has no serving version to try a canary beside: deploy it without "
                "--canary first",
            )
        wanted = {spec.name: spec.kind for spec in manifest.endpoints}
        if wanted != serving:
            raise HttpError(
                409,
                "conflict",
                f"a canary has the serving version's endpoints, of the same kinds "
                f"({_kinds(serving)}); this one has {_kinds(wanted)}: deploy without "
                "--canary to add, remove or change endpoints",
            )

    async def _deploy(
        self,
        app: str,
        manifest: AppManifest,
        digest: str,
        rolled_back_to: int | None = None,
        canary_percent: int | None = None,
    ) -> JSONResponse:
        """Store and apply a new version of the app: its code (bundle) and manifest, as
        the version that serves, or as a canary beside it."""
        if not await asyncio.to_thread(self.blobs.exists, bundle_key(digest)):
            raise HttpError(400, "invalid_request", f"upload bundle {digest} first")
        for spec in manifest.endpoints:
            missing = self.cluster.secrets.missing(spec.settings.secrets)
            if missing:
                raise HttpError(
                    400,
                    "invalid_request",
                    f"endpoint {spec.name} asks for secret {missing[0]}, which does not "
                    f"exist: create it with `ember secret set {missing[0]} KEY=VALUE`",
                )
        store = self.cluster.store
        deployment = Deployment(
            app=app,
            version=store.next_version(app),
            bundle_digest=digest,
            manifest=manifest.to_dict(),
            created_at=time.time(),
            canary_percent=canary_percent,
        )
        store.put_deployment(deployment)
        for earlier in store.canary_deployments():  # a new version replaces a canary
            if earlier.app == app and earlier.version != deployment.version:
                store.withdraw_deployment(app, earlier.version)
        if canary_percent is None:
            runtimes = self.cluster.apply_deployment(deployment)
        else:
            runtimes = apply_canary(self.cluster, deployment)
        self.cluster.collect_snapshots()
        domain = self.cluster.config.domain
        return JSONResponse(
            {
                "app": app,
                "version": deployment.version,
                "canary_percent": canary_percent,
                "serving_version": next(
                    (r.version for r in self.cluster.endpoints.values() if r.app == app), None
                ),
                "rolled_back_to": rolled_back_to,
                "endpoints": [
                    {
                        "name": r.spec.name,
                        "label": r.label,
                        "kind": r.spec.kind,
                        "methods": sorted(r.spec.methods),
                        "public": r.settings.public,
                        "urls": endpoint_urls(r.label, self.base_url, domain),
                        "unservable": self.cluster.unservable_reason(r),
                    }
                    for r in runtimes
                ],
            }
        )

    async def history(self, request: Request) -> Response:
        """Every version of the app, oldest first, and which one serves."""
        self.require(request, Scope.ADMIN)
        app = request.path_params["app"]
        deployments = self.cluster.store.list_deployments(app)
        if not deployments:
            raise HttpError(404, "not_found", f"no app named {app}")
        live = {r.version for r in self.cluster.endpoints.values() if r.app == app}
        canaries = {r.version for r in self.cluster.canaries.values() if r.app == app}
        return JSONResponse(
            {
                "app": app,
                "versions": [
                    {
                        "version": d.version,
                        "created_at": d.created_at,
                        "bundle_digest": d.bundle_digest,
                        "endpoints": [e["name"] for e in d.manifest.get("endpoints", [])],
                        "serving": d.version in live,
                        "canary_percent": d.canary_percent if d.version in canaries else None,
                        "withdrawn": d.withdrawn,
                    }
                    for d in deployments
                ],
            }
        )

    async def rollback(self, request: Request) -> Response:
        """Deploy an earlier version's code and settings again, as a new version (the
        one before the serving one unless the body names one)."""
        self.require(request, Scope.ADMIN)
        app = request.path_params["app"]
        try:
            payload = await request.json() if await request.body() else {}
            wanted = payload.get("version")
            if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int)):
                raise ValueError("version must be a whole number")
        except (ValueError, AttributeError) as exc:
            raise HttpError(400, "invalid_request", f"bad rollback request: {exc}") from None
        deployments = self.cluster.store.list_deployments(app)
        if not deployments:
            raise HttpError(404, "not_found", f"no app named {app}")
        if wanted is None:
            live = {r.version for r in self.cluster.endpoints.values() if r.app == app}
            current = max(live) if live else deployments[-1].version + 1
            # A withdrawn canary never served every call: not what a rollback goes back to.
            earlier = [d for d in deployments if d.version < current and not d.withdrawn]
            if not earlier:
                raise HttpError(
                    409, "conflict", f"{app} has no version before {current} to roll back to"
                )
            target = earlier[-1]
        else:
            chosen = next((d for d in deployments if d.version == wanted), None)
            if chosen is None:
                known = ", ".join(str(d.version) for d in deployments)
                raise HttpError(404, "not_found", f"{app} has no version {wanted}; it has {known}")
            target = chosen
        manifest = AppManifest.from_dict({**target.manifest, "app": app})
        return await self._deploy(
            app, manifest, target.bundle_digest, rolled_back_to=target.version
        )

    def _canaries_of(self, request: Request) -> tuple[str, list[EndpointRuntime]]:
        self.require(request, Scope.ADMIN)
        app = request.path_params["app"]
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
        set_canary_percent(self.cluster, app, percent)
        return self._canary_answer(app, canaries)

    async def promote_canary(self, request: Request) -> Response:
        """The canary serves every call from now on; the old version's replicas retire."""
        app, canaries = self._canaries_of(request)
        version = canaries[0].version
        self.cluster.store.set_canary_percent(app, version, None)
        for canary in canaries:
            promote_canary(self.cluster, canary.label)
        self.cluster.collect_snapshots()
        return JSONResponse({"app": app, "version": version, "promoted": True})

    async def withdraw_canary(self, request: Request) -> Response:
        """End the canary: every call goes to the serving version again."""
        app, canaries = self._canaries_of(request)
        version = canaries[0].version
        self.cluster.store.withdraw_deployment(app, version)
        for canary in canaries:
            withdraw_canary(self.cluster, canary.label, "withdrawn by `ember canary --abort`")
        self.cluster.collect_snapshots()
        return JSONResponse({"app": app, "version": version, "withdrawn": True})

    async def list_apps(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        rows = endpoint_rows(self.cluster)
        for row in rows:
            row["urls"] = endpoint_urls(row["label"], self.base_url, self.cluster.config.domain)
        on_node = self.cluster.replicas_by_worker()
        workers = [
            {
                "id": w.id,
                "name": w.name,
                "cpu": w.cpu,
                "memory": w.memory,
                "gpus": w.gpus,
                "snapshots": w.snapshots,
                "memory_limits_problem": w.memory_limits_problem,
                "cpu_limits_problem": w.cpu_limits_problem,
                "channel": w.channel,
                "labels": w.labels,
                "draining": self.cluster.takes_no_replicas(w),
                "replicas": on_node.get(w.id, 0),
                # What its caches hold, as its heartbeats say (the scheduler prefers it).
                "weights_cached_bytes": sum(w.cached_weights.values()),
                "snapshots_cached": len(w.cached_snapshots),
            }
            for w in self.cluster.workers.values()
        ]
        return JSONResponse({"endpoints": rows, "workers": workers})

    async def drain_node(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        name = self._node_name(request)
        return JSONResponse({"node": name, "draining_replicas": self.cluster.drain_node(name)})

    async def uncordon_node(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        name = request.path_params["name"]
        if not self.cluster.uncordon_node(name):
            raise HttpError(409, "not_draining", f"node {name} is not draining")
        return JSONResponse({"node": name})

    def _node_name(self, request: Request) -> str:
        name = request.path_params["name"]
        if not any(w.name == name for w in self.cluster.workers.values()):
            known = ", ".join(sorted({w.name for w in self.cluster.workers.values()})) or "none"
            raise HttpError(404, "not_found", f"no worker node named {name} (nodes: {known})")
        return name

    async def stop_app(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        app = request.path_params["app"]
        stored = self.cluster.store.delete_app(app)
        count = self.cluster.remove_app(app)
        self.cluster.collect_snapshots()
        if not stored and not count:
            raise HttpError(404, "not_found", f"no app named {app}")
        return JSONResponse({"app": app, "stopped_endpoints": count})

    async def endpoint_info(self, request: Request) -> Response:
        label = request.path_params["label"]
        self.require_call_of(request, label, f"no endpoint named {label}")
        runtime = self.cluster.endpoints.get(label)
        if runtime is None:
            raise HttpError(404, "not_found", f"no endpoint named {label}")
        return JSONResponse(
            {
                "label": label,
                "kind": runtime.spec.kind,
                "methods": [m.to_dict() for m in runtime.spec.methods.values()],
                "urls": endpoint_urls(label, self.base_url, self.cluster.config.domain),
            }
        )

    def _scaled_runtime(self, request: Request) -> EndpointRuntime:
        self.require(request, Scope.ADMIN)
        label = request.path_params["label"]
        runtime = self.cluster.endpoints.get(label)
        if runtime is None:
            raise HttpError(404, "not_found", f"no endpoint named {label} (`ember ls` lists them)")
        return runtime

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
            self.cluster.set_scaling(runtime, change)
        except json.JSONDecodeError:
            raise HttpError(400, "invalid_json", "the body is not valid JSON") from None
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        return self._scaling_answer(runtime)

    async def reset_scaling(self, request: Request) -> Response:
        """Drop the override: the deployed settings hold again."""
        runtime = self._scaled_runtime(request)
        self.cluster.set_scaling(runtime, dict.fromkeys(runtime.scaling_override))
        return self._scaling_answer(runtime)

    async def create_token(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        try:
            payload = await request.json() if await request.body() else {}
            if not isinstance(payload, dict):
                raise ValueError('send a JSON object such as {"scope": "invoke", "name": "ci"}')
            scope = Scope(payload.get("scope", "invoke"))
            name = checked_token_name(payload.get("name"))
            app = payload.get("app")
            if app is not None:
                check_name("app", app)
            limit = payload.get("rate_limit")
            rate_limit = None if limit is None else parse_rate_limit(str(limit))
            expires_at = _expiry(payload.get("expires_in"))
            token = self.tokens.create(scope, name, app, rate_limit, expires_at)
        except (ValueError, InvalidError) as exc:
            raise HttpError(400, "invalid_request", f"bad token request: {exc}") from None
        return JSONResponse(
            {
                "token": token,
                "id": token_id(hash_token(token)),
                "scope": scope.value,
                "name": name,
                "app": app,
                "rate_limit": None if rate_limit is None else str(rate_limit),
                "expires_at": expires_at,
            },
            status_code=201,
        )

    async def list_tokens(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        yours = bearer_hash(request.headers.get("authorization"))
        return JSONResponse(
            {
                "tokens": [
                    {
                        "id": token_id(t.token_hash),
                        "scope": t.scope,
                        "app": t.app,
                        "rate_limit": t.rate_limit,
                        "expires_at": t.expires_at,
                        "name": t.name,
                        "created_at": t.created_at,
                        "yours": t.token_hash == yours,
                    }
                    for t in self.tokens.stored()
                ]
            }
        )

    async def revoke_token(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        wanted = request.path_params["token_id"]
        try:
            record = self.tokens.revoke(wanted)
        except NoSuchTokenError:
            raise HttpError(
                404, "not_found", f"no token {wanted}; `ember token ls` lists their ids"
            ) from None
        except LastAdminTokenError:
            raise HttpError(
                409,
                "conflict",
                f"token {wanted} is the last admin token: revoking it would lock everyone "
                "out; create another with `ember token create --scope admin` first",
            ) from None
        return JSONResponse({"revoked": {"id": wanted, "scope": record.scope, "name": record.name}})

    async def list_secrets(self, request: Request) -> Response:
        """Names, keys and users of the secrets: never their values."""
        self.require(request, Scope.ADMIN)
        return JSONResponse(
            {
                "secrets": [
                    {
                        "name": s.name,
                        "keys": sorted(s.values),
                        "updated_at": s.updated_at,
                        "used_by": self.cluster.secret_users(s.name),
                    }
                    for s in self.cluster.secrets.all()
                ]
            }
        )

    async def put_secret(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        name = request.path_params["name"]
        try:
            payload = await request.json()
            created = self.cluster.secrets.put(name, payload.get("values"))
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        except (ValueError, AttributeError):
            raise HttpError(
                400, "invalid_request", 'a secret is a JSON object: {"values": {"KEY": "value"}}'
            ) from None
        self.cluster.secret_changed(name)
        users = self.cluster.secret_users(name)
        return JSONResponse(
            {"name": name, "created": created, "used_by": users},
            status_code=201 if created else 200,
        )

    async def delete_secret(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        name = request.path_params["name"]
        users = self.cluster.secret_users(name)
        if users:
            raise HttpError(
                409,
                "conflict",
                f"secret {name} is used by {', '.join(users)}: stop those apps, or deploy "
                "them without it, first",
            )
        if not self.cluster.secrets.delete(name):
            raise HttpError(404, "not_found", f"no secret {name}; `ember secret ls` lists them")
        return JSONResponse({"name": name, "deleted": True})

    async def cancel_call(self, request: Request) -> Response:
        """Stop an async call: out of its queue, or stopped on its replica."""
        call_id = request.path_params["call_id"]
        live, record = self._reachable_call(request, call_id)
        if live is not None and live.is_async and not live.done:
            self.cluster.cancel(live, f"call {call_id} was cancelled by its caller")
            return JSONResponse({"id": call_id, "status": "cancelled"})
        if live is not None:
            record = self.cluster.calls.get(call_id)
        if record is None:
            raise HttpError(404, "not_found", _no_call(call_id))
        if record.status.finished:
            if record.http_status == 499:
                raise HttpError(409, "conflict", f"call {call_id} was cancelled already")
            raise HttpError(
                409,
                "conflict",
                f"call {call_id} has finished ({record.status.value}, {record.http_status}): "
                "too late to cancel",
            )
        raise HttpError(409, "conflict", f"call {call_id} cannot be cancelled now; retry")

    async def usage(self, request: Request) -> Response:
        """Per endpoint, what its replicas held over the last `since` seconds (a day by
        default, at most the retention): replica-, CPU-, GiB- and GPU-seconds, starts
        by kind, inputs. Ended replicas come from the store, live ones up to now."""
        self.require(request, Scope.ADMIN)
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

    async def list_calls(self, request: Request) -> Response:
        """The newest spawned calls (scheduled runs among them) of an app or endpoint, or
        of all: ids and states, not arguments or results. Admin only: ids are what lets
        a caller read a result."""
        self.require(request, Scope.ADMIN)
        app = request.query_params.get("app", "")
        endpoint = request.query_params.get("endpoint", "")
        limit_text = request.query_params.get("limit", "50")
        if not (limit_text.isascii() and limit_text.isdigit()) or not (
            1 <= int(limit_text) <= MAX_CALLS_LISTED
        ):
            raise HttpError(
                400,
                "invalid_request",
                f"limit must be a whole number from 1 to {MAX_CALLS_LISTED}, not {limit_text!r}",
            )
        limit = int(limit_text)
        try:
            if app:
                check_name("app", app)
            if endpoint:
                check_name("endpoint", endpoint)
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        if endpoint and not app:
            raise HttpError(400, "invalid_request", "endpoint= goes with app=")
        label = make_label(app, endpoint) if endpoint else None
        records = self.cluster.calls.recent(app or None, label, limit)
        if app and not records:
            deployments = self.cluster.store.list_deployments(app)
            if not deployments:
                raise HttpError(404, "not_found", f"no app named {app} was ever deployed")
            if endpoint and not any(
                e.get("name") == endpoint
                for d in deployments
                for e in d.manifest.get("endpoints", [])
            ):
                raise HttpError(
                    404, "not_found", f"app {app} never had an endpoint named {endpoint}"
                )
        calls = [
            {
                "call_id": r.id,
                "label": r.label,
                "method": r.method,
                "status": r.status.value,
                "http_status": r.http_status,
                "attempts": r.attempts,
                "created_at": r.created_at,
                "finished_at": r.finished_at,
                "webhook": r.webhook_state or ("waiting" if r.webhook else None),
            }
            for r in records
        ]
        return JSONResponse({"calls": calls})

    def _reachable_call(
        self, request: Request, call_id: str
    ) -> tuple[Input | None, CallRecord | None]:
        """The call as its live input, else as its record (read only then). A token that
        may not reach its endpoint gets 404, as for a call that does not exist."""
        live = self.cluster.inputs.get(call_id)
        record = None if live is not None else self.cluster.calls.get(call_id)
        label = live.label if live is not None else record.label if record is not None else ""
        self.require_call_of(request, label, _no_call(call_id))
        return live, record

    async def get_call(self, request: Request) -> Response:
        call_id = request.path_params["call_id"]
        live, record = self._reachable_call(request, call_id)
        try:
            wait = min(float(request.query_params.get("wait", "0")), MAX_CALL_WAIT)
        except ValueError:
            raise HttpError(400, "invalid_request", "wait must be a number of seconds") from None
        if live is not None:  # its record, as it is once the wait is over
            if wait > 0:
                await _done_unless_stopping(live.outcome, self.stopping, wait)
            record = self.cluster.calls.get(call_id)
        if record is None:
            raise HttpError(404, "not_found", _no_call(call_id))
        if not record.status.finished:
            body = {"call_id": call_id, "status": record.status.value}
            return JSONResponse(body, status_code=202)
        answer = Outcome(
            record.http_status or 200,
            record.result or b"null",
            record.media_type or JSON_MEDIA_TYPE,
            record.filename,
        )
        return Response(
            answer.body,
            status_code=answer.status,
            headers={**answer.headers(), "X-Ember-Call-Status": record.status.value},
        )

    async def logs(self, request: Request) -> Response:
        self.require(request, Scope.ADMIN)
        app = request.path_params["app"]
        follow = request.query_params.get("follow") in ("1", "true")
        try:
            tail = int(request.query_params.get("tail", "200"))
            since = request.query_params.get("since")
            wanted = LogFilter(
                endpoint=request.query_params.get("endpoint") or None,
                replica=request.query_params.get("replica") or None,
                call=request.query_params.get("call") or None,
                grep=request.query_params.get("grep") or None,
                trace=request.query_params.get("trace") or None,
                since=None if since is None else float(since),
            )
        except ValueError:
            raise HttpError(
                400, "invalid_request", "tail must be a whole number and since a Unix time"
            ) from None
        if tail < 0:
            raise HttpError(400, "invalid_request", "tail must not be negative")
        known = any(r.app == app for r in self.cluster.endpoints.values())
        logs = self.cluster.logs
        if not known and not logs.has_lines(app):
            raise HttpError(404, "not_found", f"no app named {app}")

        async def lines() -> AsyncIterator[bytes]:
            # The history is read and the follow begins with no await between them, as
            # the body starts: no line falls between the two.
            history = logs.tail(app, tail, wanted)
            queue = logs.follow(app) if follow else None
            getter: asyncio.Future[dict[str, Any]] | None = None
            try:
                for entry in history:
                    yield (json.dumps(entry) + "\n").encode()
                if queue is None:
                    return
                while True:
                    getter = getter or asyncio.ensure_future(queue.get())
                    if not await _done_unless_stopping(getter, self.stopping, 15):
                        if self.stopping.is_set():
                            return  # the follower sees its stream end, not cut off
                        yield b"\n"  # keeps proxies from closing an idle stream
                        continue
                    entry = getter.result()
                    getter = None
                    if wanted.matches(entry):
                        yield (json.dumps(entry) + "\n").encode()
            finally:
                if getter is not None:
                    getter.cancel()
                if queue is not None:
                    logs.unfollow(app, queue)

        return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _done_unless_stopping(
    pending: asyncio.Future[Any], stopping: asyncio.Event, timeout: float
) -> bool:
    """Wait up to `timeout` seconds for `pending`, less if `stopping` is set meanwhile (or
    already); whether it is done. `pending` is left as it is either way."""
    if not pending.done() and not stopping.is_set():
        stop = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait(
                (pending, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop.cancel()
    return pending.done()


def _kinds(endpoints: dict[str, str]) -> str:
    return ", ".join(f"{name} ({kind})" for name, kind in sorted(endpoints.items()))


def _no_call(call_id: str) -> str:
    return f"no call {call_id} (results are kept for a day)"


def _expiry(expires_in: object) -> float | None:
    """A new token's expiry from the request's `expires_in` seconds (None: it never does);
    ValueError for one that is not a positive number of at most ten years."""
    if expires_in is None:
        return None
    if isinstance(expires_in, bool) or not isinstance(expires_in, int | float):
        raise ValueError(f"expires_in must be a number of seconds, not {expires_in!r}")
    if not 0 < expires_in <= MAX_TOKEN_LIFETIME_S:
        raise ValueError(f"expires_in must be above 0 and at most ten years, not {expires_in}")
    return time.time() + float(expires_in)
