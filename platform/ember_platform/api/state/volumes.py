"""`ember.Volume`: files an app's replicas and clients share, kept by the control plane.

A volume belongs to an app (`/v1/apps/{app}/volumes/{name}`) and is reached with a token
that may call that app, as its dicts and queues are. The state store lists each file's
path, size and content digest; the content is a blob named by its digest, so a file
written twice, or kept in two volumes, is stored once, and a blob goes when no file
has it any more. A file is written whole (the upload streams into a temporary blob that
becomes the content only once complete), so a reader sees the old file or the new one.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import BinaryIO

from starlette.concurrency import iterate_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ember.errors import InvalidError
from ember.state.volume_paths import check_volume_path, check_volume_prefix, parents
from ember_platform.api.state.shared_state import reachable
from ember_platform.api.workspaces import Tenancy
from ember_platform.edge.errors import HttpError
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.records import VolumeFile
from ember_platform.storage.state_store import StateStore

MAX_FILE_BYTES = 16 * 1024**3
MAX_FILES_LISTED = 100_000  # in one listing's page; `?after=` the last one asks for more
READ_ATTEMPTS = 5  # lookups of a file being read while it is overwritten, again and again
READ_CHUNK_BYTES = 1024 * 1024
DIGEST_HEADER = "X-Ember-Digest"


UPLOADS = "volumes/uploads/"  # a write's body, until it is renamed into its content
# An upload this old is no write's any more: a write ends within its request, and a
# day leaves room for the slowest links and a clock or two out of step.
STALE_UPLOAD_SECONDS = 24 * 3600


CONTENTS = "volumes/"


def content_key(digest: str) -> str:
    return CONTENTS + digest.replace(":", "-")


def _checked(check: Callable[[str], str], text: str) -> str:
    try:
        return check(text)
    except InvalidError as exc:
        raise HttpError(400, "invalid_request", str(exc)) from None


def _too_large() -> HttpError:
    return HttpError(413, "payload_too_large", f"a file is at most {MAX_FILE_BYTES} bytes")


def _listing_limit(text: str | None) -> int:
    if text is None:
        return MAX_FILES_LISTED
    if not text.isdigit() or not 1 <= int(text) <= MAX_FILES_LISTED:
        raise HttpError(
            400, "invalid_request", f"limit is a number of files from 1 to {MAX_FILES_LISTED}"
        )
    return int(text)


def _chunks(handle: BinaryIO) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(READ_CHUNK_BYTES):
            yield chunk


class VolumesApi:
    def __init__(self, tenancy: Tenancy, store: StateStore, blobs: BlobStore) -> None:
        self.tenancy = tenancy
        self.store = store
        self.blobs = blobs
        # Contents being made from an upload (by digest, how many writes make each): no
        # removal drops them meanwhile, though no file has them yet.
        self.writing: Counter[str] = Counter()

    def sweep_uploads(self, now: float | None = None) -> int:
        """Remove uploads an interrupted write left (the server stopped, or the store
        failed, between the upload and its rename into content): only a write in flight
        names an upload, and none is over a day old. Returns how many went."""
        cutoff = (time.time() if now is None else now) - STALE_UPLOAD_SECONDS
        stale = [key for key, written in self.blobs.listing(UPLOADS) if written < cutoff]
        for key in stale:
            self.blobs.delete(key)
        return len(stale)

    def blob_unwanted(self, key: str) -> bool | None:
        """Whether a volume blob whose delete failed should still go (blob_deletes.py):
        an upload always, a content unless some file has it again or a write makes it;
        None for a blob not of volumes."""
        if key.startswith(UPLOADS):
            return True
        if not key.startswith(CONTENTS):
            return None
        digest = key[len(CONTENTS) :].replace("-", ":", 1)
        return digest not in self.writing and not self.store.volume_digest_used(digest)

    def routes(self) -> list[Route]:
        volume = "/v1/apps/{app}/volumes/{name}"
        return [
            Route("/v1/apps/{app}/volumes", self.list_volumes, methods=["GET"]),
            Route(volume, self.list_files, methods=["GET"]),
            Route(volume, self.clear, methods=["DELETE"]),
            Route(volume + "/files/{path:path}", self.read, methods=["GET"]),
            Route(volume + "/files/{path:path}", self.write, methods=["PUT"]),
            Route(volume + "/files/{path:path}", self.remove, methods=["DELETE"]),
        ]

    async def list_volumes(self, request: Request) -> Response:
        app, _ = reachable(self.tenancy, request, "volume")
        rows = self.store.volumes(app)
        volumes = [{"name": name, "files": files, "bytes": size} for name, files, size in rows]
        return JSONResponse({"app": app, "volumes": volumes})

    async def list_files(self, request: Request) -> Response:
        """The volume's files in path order; `?prefix=` keeps one folder's (or one file),
        `?after=PATH` those past PATH, `?limit=` at most that many (`truncated`: more
        follow, past the last one given)."""
        app, name = reachable(self.tenancy, request, "volume")
        prefix = _checked(check_volume_prefix, request.query_params.get("prefix", ""))
        limit = _listing_limit(request.query_params.get("limit"))
        # One more than the page: whether more follow.
        after = request.query_params.get("after")
        files = self.store.volume_files(app, name, prefix, after, limit + 1)
        return JSONResponse(
            {
                "app": app,
                "name": name,
                "files": [f.to_json() for f in files[:limit]],
                "truncated": len(files) > limit,
            }
        )

    async def read(self, request: Request) -> Response:
        app, name = reachable(self.tenancy, request, "volume")
        path = _checked(check_volume_path, request.path_params["path"])
        file, handle = await self._open(app, name, path)
        headers = {"Content-Length": str(file.size), DIGEST_HEADER: file.digest}
        return StreamingResponse(
            iterate_in_threadpool(_chunks(handle)),
            media_type="application/octet-stream",
            headers=headers,
        )

    async def _open(self, app: str, name: str, path: str) -> tuple[VolumeFile, BinaryIO]:
        """The file's record and its content, opened. While the content opens (in a
        thread), a write of the file may replace it and drop the old content: the file
        is looked up again, and read as it is now."""
        for _ in range(READ_ATTEMPTS):
            file = self.store.volume_file(app, name, path)
            if file is None:
                break
            handle = await asyncio.to_thread(self.blobs.open, content_key(file.digest))
            if handle is not None:
                return file, handle
            latest = self.store.volume_file(app, name, path)
            if latest is None or latest.digest == file.digest:
                break  # removed meanwhile, or its content is truly missing
        raise HttpError(404, "not_found", f"volume {name} has no file {path}")

    async def write(self, request: Request) -> Response:
        """The body becomes the file's content, in place of any it had."""
        app, name = reachable(self.tenancy, request, "volume")
        path = _checked(check_volume_path, request.path_params["path"])
        self._check_no_conflict(app, name, path)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_FILE_BYTES:
            raise _too_large()
        hasher = hashlib.sha256()

        async def hashed() -> AsyncIterator[bytes]:
            async for chunk in request.stream():
                hasher.update(chunk)
                yield chunk

        upload = f"{UPLOADS}{os.urandom(16).hex()}"
        try:
            size = await self.blobs.put_chunks(upload, hashed(), MAX_FILE_BYTES)
        except ValueError:
            raise _too_large() from None
        except ClientDisconnect:
            return Response(status_code=499)  # nothing was kept
        digest = "sha256:" + hasher.hexdigest()
        # The content exists before any file names it (a copy, with an S3 bucket).
        self.writing[digest] += 1
        try:
            await asyncio.to_thread(self.blobs.rename, upload, content_key(digest))
            # No await from here on: the check, the record and the old content's removal
            # happen together.
            self._check_no_conflict(app, name, path)  # again: others wrote meanwhile
            previous = self.store.volume_file(app, name, path)
            file = VolumeFile(path, digest, size, time.time())
            self.store.volume_put_file(app, name, file)
        except BaseException:
            self._written(digest)
            self._drop_unused([digest])
            raise
        self._written(digest)
        if previous is not None:
            self._drop_unused([previous.digest])
        return JSONResponse(file.to_json())

    def _written(self, digest: str) -> None:
        self.writing[digest] -= 1
        if not self.writing[digest]:
            del self.writing[digest]

    async def remove(self, request: Request) -> Response:
        """Remove a file, or with `?recursive=true` a folder and all it holds."""
        app, name = reachable(self.tenancy, request, "volume")
        path = _checked(check_volume_path, request.path_params["path"])
        recursive = request.query_params.get("recursive", "").lower() in ("1", "true", "yes")
        files = self.store.volume_files(app, name, path)
        if not files:
            raise HttpError(404, "not_found", f"volume {name} has no file or folder {path}")
        if not recursive and (len(files) > 1 or files[0].path != path):
            raise HttpError(
                409, "is_a_folder", f"{path} is a folder of {len(files)} files: remove it "
                "with recursive=true (`ember volume rm -r`)"
            )  # fmt: skip
        return JSONResponse({"removed": self._remove(app, name, files)})

    async def clear(self, request: Request) -> Response:
        app, name = reachable(self.tenancy, request, "volume")
        return JSONResponse(
            {"removed": self._remove(app, name, self.store.volume_files(app, name))}
        )

    def _remove(self, app: str, name: str, files: list[VolumeFile]) -> int:
        self.store.volume_remove(app, name, [f.path for f in files])
        self._drop_unused([f.digest for f in files])
        return len(files)

    def _check_no_conflict(self, app: str, name: str, path: str) -> None:
        """A path cannot be a file and a folder at once, as on a disk."""
        for folder in parents(path):
            if self.store.volume_file(app, name, folder) is not None:
                raise HttpError(
                    409, "path_conflict", f"{folder} is a file in volume {name}, not a folder"
                )
        inside = [f for f in self.store.volume_files(app, name, path) if f.path != path]
        if inside:
            raise HttpError(
                409, "path_conflict", f"{path} is a folder in volume {name} ({len(inside)} files)"
            )

    def _drop_unused(self, digests: list[str]) -> None:
        for digest in set(digests):
            if digest not in self.writing and not self.store.volume_digest_used(digest):
                self.blobs.delete(content_key(digest))
