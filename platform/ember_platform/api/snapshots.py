"""The snapshot images themselves, for operators (`ember snapshot ls | rm`): what each
endpoint's replicas restore from, how big it is, how often it was used and which nodes
hold it; why an endpoint has none; and dropping an endpoint's images so that the next
replica to start boots cold and takes a new one (after the weights it loads in
`enter(snap=True)` changed in place, say, which no snapshot key can see). A deploy token
sees and drops its workspace's; an admin token lists every workspace's with
`?all_workspaces=true`.

And the images' bytes, as workers upload the ones they take and fetch the ones they
restore (worker tokens)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.wire.blob_downloads import DIRECT_HEADER
from ember.wire.labels import app_key, label_names, split_label
from ember_platform.api.workspaces import Tenancy, in_listing, in_workspace
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.security.tokens import Scope
from ember_platform.snapshots.registry import RETRY_FAILED_AFTER, SNAPSHOT_KEY, blob_key
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.records import SnapshotRecord

MAX_SNAPSHOT_BYTES = 64 * 1024**3


def _versions(cluster: Cluster, label: str) -> dict[str, EndpointRuntime]:
    """The deployed runtimes of an endpoint (serving, canary) by bundle digest."""
    runtimes = [cluster.endpoints.get(label), cluster.canaries.get(label)]
    return {r.bundle_digest: r for r in runtimes if r is not None}


def _names(label: str) -> dict[str, str]:
    """A row's workspace, app (as named in its workspace) and endpoint, by the one label
    parser: `team--shop--fn` is app `shop` of `team`, not app `team` of main. A label
    that is none (never stored) names no workspace, so no listing shows it."""
    names = label_names(label)
    workspace, app, endpoint = names if names is not None else ("", "", "")
    return {"workspace": workspace, "app": app, "endpoint": endpoint, "label": label}


def image_row(cluster: Cluster, record: SnapshotRecord) -> dict[str, Any]:
    """What `ember snapshot ls` shows of a stored image."""
    runtime = _versions(cluster, record.label).get(record.bundle_digest)
    nodes = sorted(
        worker.name
        for worker in cluster.workers.values()
        if (record.key, record.image_id) in worker.cached_snapshots
    )
    return {
        "key": record.key,
        "image_id": record.image_id,
        **_names(record.label),
        "state": "ready",
        "version": runtime.version if runtime is not None else None,
        "size": record.size,
        "raw_size": record.raw_size,
        "dump_seconds": record.dump_seconds,
        "created_at": record.created_at,
        "restores": record.restores,
        "last_restored_at": record.last_restored_at,
        "last_restore_seconds": record.last_restore_seconds,
        "nodes": nodes,
    }


def pending_rows(cluster: Cluster) -> list[dict[str, Any]]:
    """Images being taken, and takes that failed and wait before the next try."""
    rows: list[dict[str, Any]] = []
    for key, take in cluster.snapshots.taking.items():
        worker = cluster.workers.get(take.worker_id)
        rows.append(
            {
                "key": key,
                **_names(take.label),
                "state": "publishing" if take.dumped else "taking",
                "nodes": [worker.name] if worker is not None else [],
            }
        )
    for key, failed in cluster.snapshots.failed.items():
        rows.append(
            {
                "key": key,
                **_names(failed.label),
                "state": "failed",
                "failed_at": failed.at,
                "retry_at": failed.at + RETRY_FAILED_AFTER,
                "reason": failed.reason,
            }
        )
    return rows


def endpoint_row(runtime: EndpointRuntime) -> dict[str, Any]:
    """Whether an endpoint snapshots at all, and why not where it cannot."""
    return {
        **_names(runtime.label),
        "snapshot": runtime.settings.snapshot,
        "note": runtime.snapshot_note,
    }


class SnapshotsApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster, blobs: BlobStore) -> None:
        self.tenancy = tenancy
        self.tokens = tenancy.tokens
        self.cluster = cluster
        self.blobs = blobs

    def routes(self) -> list[Route]:
        # The images' bytes (put_snapshot, get_snapshot) are routed by api/v1.py, in their
        # place among the API's other routes.
        return [
            Route("/v1/snapshots", self.list_snapshots, methods=["GET"]),
            Route("/v1/snapshots", self.forget_endpoints, methods=["DELETE"]),
            Route("/v1/snapshots/{key}", self.drop_snapshot, methods=["DELETE"]),
        ]

    async def put_snapshot(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.WORKER)
        key = request.path_params["key"]
        if not SNAPSHOT_KEY.match(key):
            raise HttpError(400, "invalid_request", "snapshot keys are 32 hex digits")
        try:
            size = await self.blobs.put_chunks(blob_key(key), request.stream(), MAX_SNAPSHOT_BYTES)
        except ValueError as exc:
            raise HttpError(413, "payload_too_large", str(exc)) from None
        return JSONResponse({"key": key, "size": size}, status_code=201)

    async def get_snapshot(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.WORKER)
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

    async def list_snapshots(self, request: Request) -> Response:
        """Stored images, the newest first, then those being taken or failed; and the
        deployed endpoints, for those that have none: of the request's workspace, or of
        every one for an admin's `?all_workspaces=true`. `?app=` keeps one app's."""
        _, workspace = self.tenancy.listed(request)
        named = request.query_params.get("app")
        app = None if named is None else self.tenancy.app(request, named)
        records = sorted(self.cluster.snapshots.ready.values(), key=lambda r: -r.created_at)
        rows = [image_row(self.cluster, r) for r in records] + pending_rows(self.cluster)
        endpoints = [endpoint_row(r) for r in self.cluster.endpoints.values()]

        def kept(row: dict[str, Any]) -> bool:
            if not row["workspace"]:
                return False
            key = app_key(row["workspace"], row["app"])
            return (app is None or key == app) and in_listing(key, workspace)

        return JSONResponse(
            {
                "snapshots": [row for row in rows if kept(row)],
                "endpoints": [row for row in endpoints if kept(row)],
                "now": time.time(),
            }
        )

    async def forget_endpoints(self, request: Request) -> Response:
        """`?app=APP` (and `&endpoint=NAME`): drop the images of the app's endpoints (or
        of one) and forget their failed takes; the next replica of each takes a new one.
        Replicas running now go on as they are."""
        named = request.query_params.get("app")
        if not named:
            self.tenancy.grant(request, Scope.DEPLOY)
            raise HttpError(400, "invalid_request", "say which app's snapshots: ?app=APP")
        app = self.tenancy.app(request, named)
        endpoint = request.query_params.get("endpoint")
        snapshots = self.cluster.snapshots
        labels = {r.label for r in snapshots.ready.values()} | {
            f.label for f in snapshots.failed.values()
        }
        chosen = sorted(
            label
            for label in labels
            if (parts := split_label(label)) is not None
            and parts[0] == app
            and (endpoint is None or parts[1] == endpoint)
        )
        if not chosen and not any(
            (parts := split_label(label)) is not None
            and parts[0] == app
            and (endpoint is None or parts[1] == endpoint)
            for label in self.cluster.endpoints
        ):
            what = f"endpoint {named}--{endpoint}" if endpoint else f"app {named}"
            raise HttpError(
                404, "not_found", f"no {what} is deployed and no snapshot of it is stored"
            )
        dropped: list[str] = []
        failures = 0
        for label in chosen:
            keys, forgotten = self.cluster.snapshots.forget_endpoint(label)
            dropped += keys
            failures += forgotten
            self._log_dropped(label, keys, forgotten)
        self.cluster.wake.set()
        return JSONResponse({"dropped": dropped, "failures_forgotten": failures})

    async def drop_snapshot(self, request: Request) -> Response:
        """Drop one image by its key; the next replica of its endpoint takes a new one."""
        _, workspace = self.tenancy.workspace(request)
        key = request.path_params["key"]
        record = self.cluster.snapshots.ready.get(key) if SNAPSHOT_KEY.match(key) else None
        parts = split_label(record.label) if record is not None else None
        if record is None or parts is None or not in_workspace(parts[0], workspace):
            raise HttpError(404, "not_found", f"no snapshot {key} is stored (`ember snapshot ls`)")
        self.cluster.snapshots.drop(key)
        self._log_dropped(record.label, [key], 0)
        self.cluster.wake.set()
        return JSONResponse({"dropped": [key], "failures_forgotten": 0})

    def _log_dropped(self, label: str, keys: list[str], failures: int) -> None:
        parts = split_label(label)
        if parts is None or not (keys or failures):
            return
        what = ", ".join(key[:12] for key in keys) or "none stored"
        self.cluster.logs.system(
            parts[0],
            parts[1],
            f"snapshots dropped by an operator (ember snapshot rm): {what}; the next replica "
            "to start boots cold and takes a new one",
        )
