"""Built images in the blob store. Workers build them (never this process): each layer's
OCI layer tar is stored by its content (`image-blobs/<sha256>`, checked here as it
streams in), then the layer itself, by its digest (the hash of its step's definition
and of its parent's digest), as a small entry naming that tar; last the image's record:
its layers in order. A layer whose entry is here is not built again. Operators list and
drop images (`ember image ls | rm`): dropping removes the record, and the layers and
tars that no other image record names, and tells the nodes to free their copies."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember_platform.edge.errors import HttpError
from ember_platform.images.blob_keys import HEX, RECORDS, blob_key, layer_key, record_key
from ember_platform.images.grants import ImageGrants
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.storage.blobs import BlobStore

BYTE_RANGE = re.compile(r"bytes=(\d+)-(\d+)\Z")
MAX_LAYER_BYTES = 32 * 1024**3
MAX_RECORD_BYTES = 1024 * 1024


def digest_hex(request: Request) -> str:
    """The hex of the path's `{digest}` (sha256:<64 hex>, or the hex alone)."""
    value = str(request.path_params["digest"]).removeprefix("sha256:")
    if not HEX.match(value):
        raise HttpError(400, "invalid_request", "digests are sha256:<64 hex>")
    return value


async def put_checked(
    blobs: BlobStore, request: Request, hex_digest: str, key: str, limit: int, refusal: str
) -> int:
    """The request's body stored at `key` once its bytes are seen to have `hex_digest`
    (written under a partial name first, so a reader never sees a bad or short one);
    413 past `limit` bytes, 400 saying `refusal` if the digest differs. Its size."""
    hasher = hashlib.sha256()

    async def hashed() -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            hasher.update(chunk)
            yield chunk

    partial = key.rsplit("/", 1)[0] + "/partial-" + secrets.token_hex(8)
    try:
        size = await blobs.put_chunks(partial, hashed(), limit)
    except ValueError as exc:
        await asyncio.to_thread(blobs.delete, partial)
        raise HttpError(413, "payload_too_large", str(exc)) from None
    if hasher.hexdigest() != hex_digest:
        await asyncio.to_thread(blobs.delete, partial)
        raise HttpError(400, "invalid_request", refusal)
    await asyncio.to_thread(blobs.rename, partial, key)
    return size


def check_layer(data: Any) -> dict[str, Any]:
    """A layer's entry: the sha256 and size of its tar, and its step's kind."""
    if (
        not isinstance(data, dict)
        or not HEX.match(str(data.get("sha256", "")))
        or not isinstance(data.get("size"), int)
        or not isinstance(data.get("kind"), str)
    ):
        raise ValueError(f"{data!r} is not a layer's entry (sha256, size, kind)")
    entry = {"sha256": data["sha256"], "size": data["size"], "kind": data["kind"]}
    # A registry image's configuration: its variables and working folder.
    env, workdir, manifest = data.get("env"), data.get("workdir"), data.get("manifest")
    if env is not None:
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError("a layer's env maps names to values")
        entry["env"] = env
    if workdir is not None:
        if (
            not isinstance(workdir, str)
            or not workdir.startswith("/")
            or ".." in workdir.split("/")
        ):
            raise ValueError("a layer's workdir is an absolute path without '..'")
        entry["workdir"] = workdir
    # A registry layer's manifest: what another workspace's credentials are checked for.
    if manifest is not None:
        if not isinstance(manifest, str) or not HEX.match(manifest.removeprefix("sha256:")):
            raise ValueError("a layer's manifest is a sha256 digest")
        entry["manifest"] = manifest
    return entry


def check_record(data: Any) -> dict[str, Any]:
    """An image record as a worker writes it: its layers in order, each its digest and
    its entry."""
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers:
        raise ValueError("an image record lists its layers")
    for layer in layers:
        if not isinstance(layer, dict) or not HEX.match(str(layer.get("digest", ""))[7:]):
            raise ValueError(f"{layer!r} is not a layer of an image record")
        check_layer(layer)
    return dict(data)


class ImagesApi:
    def __init__(
        self,
        tokens: TokenRegistry,
        blobs: BlobStore,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.tokens = tokens
        self.blobs = blobs
        self.on_drop = on_drop  # told each image dropped: nodes free their copies
        self.grants = ImageGrants(blobs)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/images", self.list_images, methods=["GET"]),
            Route("/v1/images/{digest}", self.get_record, methods=["GET"]),
            Route("/v1/images/{digest}", self.put_record, methods=["PUT"]),
            Route("/v1/images/{digest}", self.drop_image, methods=["DELETE"]),
            Route("/v1/image-layers/{digest}", self.get_layer, methods=["GET"]),
            Route("/v1/image-layers/{digest}", self.put_layer, methods=["PUT"]),
            Route("/v1/image-blobs/{digest}", self.get_blob, methods=["GET"]),
            Route("/v1/image-blobs/{digest}", self.put_blob, methods=["PUT"]),
        ]

    def _worker(self, request: Request) -> None:
        self.tokens.require(request.headers.get("authorization"), Scope.WORKER)

    async def put_blob(self, request: Request) -> Response:
        """A layer tar, stored under its sha256 once its bytes are seen to have it."""
        self._worker(request)
        hex_digest = digest_hex(request)
        key = blob_key(hex_digest)
        size = await put_checked(
            self.blobs,
            request,
            hex_digest,
            key,
            MAX_LAYER_BYTES,
            "the layer's bytes do not have its sha256",
        )
        return JSONResponse({"size": size}, status_code=201)

    async def get_blob(self, request: Request) -> Response:
        self._worker(request)
        hex_digest = digest_hex(request)
        wanted = request.headers.get("range")
        if wanted is not None:
            return await self._blob_range(hex_digest, wanted)
        handle = await asyncio.to_thread(self.blobs.open, blob_key(hex_digest))
        if handle is None:
            raise HttpError(404, "not_found", f"no layer tar sha256:{hex_digest}")

        async def chunks() -> AsyncIterator[bytes]:
            with handle:
                while chunk := await asyncio.to_thread(handle.read, 4 * 1024 * 1024):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/vnd.oci.image.layer.v1.tar")

    async def _blob_range(self, hex_digest: str, wanted: str) -> Response:
        """One byte range of a stored blob (a lazy image root reads its files so): from a
        bucket, a redirect to it; from the folder, the bytes."""
        match = BYTE_RANGE.match(wanted.strip())
        if match is None:
            raise HttpError(416, "invalid_request", "one range, bytes=FIRST-LAST")
        first, last = int(match[1]), int(match[2])
        key = blob_key(hex_digest)
        direct = await asyncio.to_thread(self.blobs.direct_url, key)
        if direct is not None:
            return Response(status_code=307, headers={"Location": direct})
        handle = await asyncio.to_thread(self.blobs.open, key)
        if handle is None:
            raise HttpError(404, "not_found", f"no blob sha256:{hex_digest}")

        def read() -> tuple[bytes, int]:
            with handle:
                size = handle.seek(0, 2)
                handle.seek(first)
                return handle.read(max(0, min(last, size - 1) - first + 1)), size

        data, size = await asyncio.to_thread(read)
        if first >= size or last < first:
            raise HttpError(416, "invalid_request", f"the blob has {size} bytes")
        return Response(
            data,
            status_code=206,
            media_type="application/octet-stream",
            headers={"Content-Range": f"bytes {first}-{first + len(data) - 1}/{size}"},
        )

    async def put_layer(self, request: Request) -> Response:
        """A built layer: its digest names the tar of its files (stored first)."""
        self._worker(request)
        hex_digest = digest_hex(request)
        try:
            entry = check_layer(json.loads(await request.body()))
        except ValueError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        if not await asyncio.to_thread(self.blobs.exists, blob_key(entry["sha256"])):
            raise HttpError(409, "conflict", f"layer tar sha256:{entry['sha256']} is not stored")
        await asyncio.to_thread(self.blobs.put, layer_key(hex_digest), json.dumps(entry).encode())
        return JSONResponse(entry, status_code=201)

    async def get_layer(self, request: Request) -> Response:
        self._worker(request)
        data = await asyncio.to_thread(self.blobs.get, layer_key(digest_hex(request)))
        if data is None:
            raise HttpError(404, "not_found", "no such layer")
        return Response(data, media_type="application/json")

    async def put_record(self, request: Request) -> Response:
        self._worker(request)
        hex_digest = digest_hex(request)
        body = await request.body()
        try:
            if len(body) > MAX_RECORD_BYTES:
                raise ValueError("an image record is at most 1 MiB")
            record = check_record(json.loads(body))
            if record["layers"][-1]["digest"] != "sha256:" + hex_digest:
                raise ValueError("an image's digest is its top layer's")
        except ValueError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        for layer in record["layers"]:
            if not await asyncio.to_thread(self.blobs.exists, blob_key(layer["sha256"])):
                raise HttpError(409, "conflict", f"layer {layer['digest']} is not stored")
        await asyncio.to_thread(self.blobs.put, record_key(hex_digest), json.dumps(record).encode())
        return JSONResponse({"digest": "sha256:" + hex_digest}, status_code=201)

    async def get_record(self, request: Request) -> Response:
        self._worker(request)
        data = await asyncio.to_thread(self.blobs.get, record_key(digest_hex(request)))
        if data is None:
            raise HttpError(404, "not_found", "no such image")
        return Response(data, media_type="application/json")

    async def _records(self) -> list[dict[str, Any]]:
        listing = await asyncio.to_thread(self.blobs.listing, RECORDS)
        records = []
        for key, written in listing:
            data = await asyncio.to_thread(self.blobs.get, key)
            if data is None:
                continue
            record = json.loads(data)
            record["built_at"] = written
            records.append(record)
        return records

    async def list_images(self, request: Request) -> Response:
        """Built images, the newest first: digest, steps, size of their layers."""
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        rows = [
            {
                "digest": record["layers"][-1]["digest"],
                "steps": [layer.get("kind", "") for layer in record["layers"]],
                "layers": len(record["layers"]),
                "size": sum(int(layer["size"]) for layer in record["layers"]),
                "built_at": record["built_at"],
            }
            for record in await self._records()
        ]
        rows.sort(key=lambda row: -row["built_at"])
        return JSONResponse({"images": rows})

    async def drop_image(self, request: Request) -> Response:
        """The image's record, and its layers that no other record names (a layer
        shared by another image stays); the next build of it builds them again."""
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        hex_digest = digest_hex(request)
        records = await self._records()
        mine = [r for r in records if r["layers"][-1]["digest"] == "sha256:" + hex_digest]
        if not mine:
            raise HttpError(404, "not_found", f"no image sha256:{hex_digest}")
        others = [r for r in records if r["layers"][-1]["digest"] != "sha256:" + hex_digest]
        kept = {layer["digest"] for record in others for layer in record["layers"]}
        kept_tars = {layer["sha256"] for record in others for layer in record["layers"]}
        dropped = [layer for layer in mine[0]["layers"] if layer["digest"] not in kept]
        await asyncio.to_thread(self.blobs.delete, record_key(hex_digest))
        index = mine[0].get("lazy_index")  # the image's file index (worker/.../lazy)
        if isinstance(index, dict) and HEX.match(str(index.get("sha256", ""))):
            await asyncio.to_thread(self.blobs.delete, blob_key(index["sha256"]))
        for layer in dropped:
            await asyncio.to_thread(self.blobs.delete, layer_key(layer["digest"][7:]))
            if layer.get("kind") == "registry":
                await asyncio.to_thread(self.grants.drop_layer, layer["digest"][7:])
            if layer["sha256"] not in kept_tars:
                await asyncio.to_thread(self.blobs.delete, blob_key(layer["sha256"]))
        if self.on_drop is not None:
            self.on_drop("sha256:" + hex_digest)
        return JSONResponse({"digest": "sha256:" + hex_digest, "layers_dropped": len(dropped)})
