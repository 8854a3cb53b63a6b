"""Deploying an app (`ember deploy | history | rollback`): its code as a bundle uploaded
first, then each new version stored and applied (as the serving version, or as a canary
beside it); the versions so far, and a rollback that deploys an earlier one again."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.declarations.settings import check_name
from ember.errors import BundleError, BundleTooLargeError, InvalidError
from ember.wire.bundle_rules import check_bundle
from ember.wire.labels import endpoint_urls, split_app_key
from ember.wire.spec import AppManifest
from ember_platform.api.images import record_key
from ember_platform.api.workspaces import Tenancy
from ember_platform.core.canaries import check_canary_percent
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.images.grants import ImageGrants, made_at
from ember_platform.runtime.cluster_model import settings_demand
from ember_platform.scaling.scheduler import unservable_reason
from ember_platform.security.tokens import Scope
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.records import Deployment

MAX_BUNDLE_BYTES = 256 * 1024 * 1024


def bundle_key(digest: str) -> str:
    return "bundles/" + digest.replace(":", "-")


class DeploysApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster, blobs: BlobStore, base_url: str) -> None:
        self.tenancy = tenancy
        self.tokens = tenancy.tokens
        self.cluster = cluster
        self.blobs = blobs
        self.grants = ImageGrants(blobs)
        self.base_url = base_url

    async def put_bundle(self, request: Request) -> Response:
        # Bundles are content-addressed and shared: storing one reveals nothing of others.
        self.tokens.require(request.headers.get("authorization"), Scope.DEPLOY)
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
        # The worker's rules, read here in full (off the event loop): a bundle that no
        # node would extract is refused now, and nothing of it is stored.
        body = bytes(data)
        try:
            await asyncio.to_thread(check_bundle, body)
        except BundleTooLargeError as exc:
            raise HttpError(413, "payload_too_large", str(exc)) from None
        except BundleError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        await asyncio.to_thread(self.blobs.put, bundle_key(digest), body)
        return JSONResponse({"digest": digest, "size": len(data)}, status_code=201)

    async def get_bundle(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.WORKER)
        data = await asyncio.to_thread(self.blobs.get, bundle_key(request.path_params["digest"]))
        if data is None:
            raise HttpError(404, "not_found", "no such bundle")
        return Response(data, media_type="application/gzip")

    async def deploy(self, request: Request) -> Response:
        app = self.tenancy.app(request, request.path_params["app"])
        try:
            payload = await request.json()
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
        await self._require_built_images(app, manifest)
        self._require_gangs_fit(manifest)
        if canary is not None:
            self._check_canary(app, manifest)
        return await self._deploy(app, manifest, digest, canary_percent=canary)

    async def _require_built_images(self, app: str, manifest: AppManifest) -> None:
        """An endpoint's image= is built before its deploy (`ember deploy` asks for the
        build first, POST /v1/image-builds): replicas never wait for one. An image
        pulled from a registry is built only for the workspaces whose credentials the
        registry took for it (images/grants.py): to another it is not built at all."""
        workspace = split_app_key(app)[0]
        created_at = made_at(self.tenancy.workspaces, workspace)

        def built(digest: str) -> bool:
            data = self.blobs.get(record_key(digest.removeprefix("sha256:")))
            if data is None:
                return False
            layers = json.loads(data).get("layers") or []
            return self.grants.holds(workspace, created_at, layers)

        for spec in manifest.endpoints:
            digest = spec.settings.image_digest
            if digest is not None and not await asyncio.to_thread(built, digest):
                raise HttpError(
                    409,
                    "conflict",
                    f"endpoint {spec.name}'s image {digest[7:19]} is not built: `ember "
                    "deploy` builds it first (POST /v1/image-builds)",
                )

    def _require_gangs_fit(self, manifest: AppManifest) -> None:
        """A gang (`nodes=`) that no set of the registered nodes could ever run is refused,
        saying what is missing (workers still reconnecting: no verdict yet)."""
        if self.cluster.roster.reconnecting():
            return
        for spec in manifest.endpoints:
            if spec.settings.nodes < 2:
                continue
            nodes = self.cluster.state.capacities()
            reason = unservable_reason(settings_demand(spec.settings), nodes)
            if reason is not None:
                raise HttpError(400, "cannot_fit", f"endpoint {spec.name}: {reason}")

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
        workspace = split_app_key(app)[0]
        for spec in manifest.endpoints:
            missing = self.cluster.secrets.missing(workspace, spec.settings.secrets)
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
            runtimes = self.cluster.deployments.apply(deployment)
        else:
            runtimes = self.cluster.trials.apply(deployment)
        self.cluster.collect_garbage()
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
                        "unservable": self.cluster.roster.unservable_reason(r),
                    }
                    for r in runtimes
                ],
            }
        )

    async def history(self, request: Request) -> Response:
        """Every version of the app, oldest first, and which one serves."""
        app = self.tenancy.app(request, request.path_params["app"])
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
        app = self.tenancy.app(request, request.path_params["app"])
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
        await self._require_built_images(app, manifest)
        return await self._deploy(
            app, manifest, target.bundle_digest, rolled_back_to=target.version
        )


def _kinds(endpoints: dict[str, str]) -> str:
    return ", ".join(f"{name} ({kind})" for name, kind in sorted(endpoints.items()))
