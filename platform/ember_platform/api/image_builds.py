"""Image builds asked for by `ember deploy` (deploy scope): whether an image is built,
the local files its copy steps need (uploaded by the client, each as one tar stored by
its sha256: a builder may run on another machine), and a build, whose output streams
back as JSON lines (`{"line": ...}`, then `{"done": true, "error": ...}`). The build runs
on a worker node (images/builds.py); a built image answers at once, building nothing.

An image pulled from a registry is built only for the workspaces whose credentials the
registry took for it (images/grants.py): to another, it is not built, and its build
goes to a node that asks the registry with that workspace's secret before it reuses
the stored layers, the grant written before the build's end is told."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.errors import InvalidError
from ember.images.image import Image
from ember_platform.api.images import digest_hex, put_checked
from ember_platform.api.workspaces import Tenancy
from ember_platform.edge.errors import HttpError
from ember_platform.images.blob_keys import HEX, files_key, record_key
from ember_platform.images.builds import ImageBuilds
from ember_platform.images.grants import ImageGrants, made_at, registry_base
from ember_platform.security.secrets import SecretRegistry
from ember_platform.security.tokens import Scope
from ember_platform.storage.blobs import BlobStore

MAX_FILES_BYTES = 4 * 1024**3 + 64 * 1024**2  # the SDK's limit on a copy, and the tar's own


def _line(data: dict[str, Any]) -> bytes:
    return (json.dumps(data) + "\n").encode()


class ImageBuildsApi:
    def __init__(
        self, tenancy: Tenancy, builds: ImageBuilds, blobs: BlobStore, secrets: SecretRegistry
    ) -> None:
        self.tenancy = tenancy
        self.builds = builds
        self.blobs = blobs
        self.secrets = secrets
        self.grants = ImageGrants(blobs)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/image-builds", self.build, methods=["POST"]),
            Route("/v1/image-builds/{digest}", self.built, methods=["GET"]),
            Route("/v1/image-files/{digest}", self.put_files, methods=["PUT"]),
            Route("/v1/image-files/{digest}", self.get_files, methods=["GET"]),
        ]

    async def is_built(self, digest: str, workspace: str) -> bool:
        """Whether the image is built for `workspace`: stored, and (pulled from a
        registry) with a grant of its."""

        def built() -> bool:
            data = self.blobs.get(record_key(digest.removeprefix("sha256:")))
            if data is None:
                return False
            layers = json.loads(data).get("layers") or []
            created_at = made_at(self.tenancy.workspaces, workspace)
            return self.grants.holds(workspace, created_at, layers)

        return await asyncio.to_thread(built)

    async def built(self, request: Request) -> Response:
        _, workspace = self.tenancy.workspace(request)
        hex_digest = digest_hex(request)
        return JSONResponse({"built": await self.is_built(hex_digest, workspace)})

    async def put_files(self, request: Request) -> Response:
        """A tar of a copy step's files, stored under its sha256 once its bytes have it."""
        self.tenancy.workspace(request)
        hex_digest = digest_hex(request)
        key = files_key(hex_digest)
        size = await put_checked(
            self.blobs,
            request,
            hex_digest,
            key,
            MAX_FILES_BYTES,
            "the files' bytes do not have their sha256",
        )
        return JSONResponse({"size": size}, status_code=201)

    async def get_files(self, request: Request) -> Response:
        self.tenancy.tokens.require(request.headers.get("authorization"), Scope.WORKER)
        hex_digest = digest_hex(request)
        handle = await asyncio.to_thread(self.blobs.open, files_key(hex_digest))
        if handle is None:
            raise HttpError(404, "not_found", f"no uploaded files sha256:{hex_digest}")

        async def chunks() -> AsyncIterator[bytes]:
            with handle:
                while chunk := await asyncio.to_thread(handle.read, 4 * 1024 * 1024):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/x-tar")

    async def build(self, request: Request) -> Response:
        """Build the image unless it is built; its output as JSON lines."""
        _, workspace = self.tenancy.workspace(request)
        try:
            payload = await request.json()
            image = Image.from_dict(payload.get("image"))
            files = payload.get("files") or {}
            if not isinstance(files, dict) or not all(
                isinstance(v, str) and HEX.match(v) for v in files.values()
            ):
                raise InvalidError("files maps a copy step's layer digest to a tar's sha256")
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        except (ValueError, AttributeError) as exc:
            raise HttpError(400, "invalid_request", f"malformed image build: {exc}") from None
        steps = image.to_dict()["steps"]
        created_at = made_at(self.tenancy.workspaces, workspace)
        granted = await asyncio.to_thread(self.grants.holds, workspace, created_at, steps)
        stored = await asyncio.to_thread(
            self.blobs.exists, record_key(image.digest.removeprefix("sha256:"))
        )
        if stored and granted:
            done = {"done": True, "error": None, "built": 0, "reused": len(image.layers)}
            line = f"image {image.digest[7:19]}: built already, nothing to build"
            return Response(_line({"line": line}) + _line(done), media_type="application/x-ndjson")
        for layer in image.layers:
            if layer.step["kind"] in ("local_dir", "local_file") and layer.digest not in files:
                raise HttpError(
                    400, "invalid_request", f"upload the files of {layer.step['kind']} first"
                )
        values: dict[str, dict[str, str]] = {}
        for layer in image.layers:
            name = layer.step.get("secret")
            if layer.step["kind"] == "registry" and name:
                if self.secrets.missing(workspace, [name]):
                    raise HttpError(
                        400,
                        "invalid_request",
                        f"from_registry names secret {name}, which does not exist: create "
                        f"it with `ember secret set {name} REGISTRY_USERNAME=... "
                        "REGISTRY_PASSWORD=...`",
                    )
                values[name] = self.secrets.env_for(workspace, [name])
        private = registry_base(steps) is not None
        try:
            build = self.builds.start(
                image.to_dict(),
                files,
                values,
                workspace=workspace if private else None,
                verify_registry=not granted,
            )
        except ValueError as exc:
            raise HttpError(503, "no_capacity", str(exc)) from None

        async def lines() -> AsyncIterator[bytes]:
            yield _line(
                {"line": f"building image {image.digest[7:19]} on worker {build.worker_name}"}
            )
            async for line in self.builds.follow(build):
                yield _line({"line": line})
            if private and build.error is None and build.summary:
                # Before the end is told: the deploy that follows it checks the grant.
                await asyncio.to_thread(self.grants.add, workspace, created_at, steps)
            yield _line({"done": True, "error": build.error, **build.summary})

        return StreamingResponse(lines(), media_type="application/x-ndjson")
