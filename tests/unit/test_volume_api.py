"""The control plane's volume API, served in this process with a real store and blob store:
listings in pages, and reads that meet a write of the same file."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from store_backends import StoreOpener

from ember_platform.api.state.volumes import VolumesApi
from ember_platform.api.workspaces import Tenancy
from ember_platform.edge.errors import HttpError, http_error
from ember_platform.errors import PlatformError
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.security.workspaces import WorkspaceRegistry
from ember_platform.storage.blobs import LocalBlobStore
from ember_platform.storage.tables.store import TableStateStore

FILES = "/v1/apps/app/volumes/v"


class PausingBlobStore(LocalBlobStore):
    """A local blob store that runs `before_open` (once) as a read opens a blob: the
    moment another request may change the file being read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.before_open: Callable[[], None] | None = None

    def open(self, key: str) -> BinaryIO | None:
        hook, self.before_open = self.before_open, None
        if hook is not None:
            hook()
        return super().open(key)


async def _http_error(request: Request, error: Exception) -> Response:
    if not isinstance(error, HttpError | PlatformError):
        raise error
    exc = http_error(error)
    return Response(exc.body(), exc.status, exc.headers, media_type="application/json")


ERROR_HANDLERS = {HttpError: _http_error, PlatformError: _http_error}


def _serve(tmp_path: Path, store: TableStateStore) -> tuple[httpx.AsyncClient, PausingBlobStore]:
    tokens = TokenRegistry(store)
    token = tokens.create(Scope.ADMIN, "test")
    blobs = PausingBlobStore(tmp_path / "blobs")
    api = VolumesApi(Tenancy(tokens, WorkspaceRegistry(store)), store, blobs)
    app = Starlette(routes=api.routes(), exception_handlers=ERROR_HANDLERS)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://cp",
        headers={"Authorization": f"Bearer {token}"},
    )
    return client, blobs


def test_a_read_that_meets_an_overwrite_gets_the_new_content(
    tmp_path: Path, open_store: StoreOpener
) -> None:
    store = open_store()

    async def scenario() -> None:
        client, blobs = _serve(tmp_path, store)
        async with client:
            assert (await client.put(f"{FILES}/files/hot.txt", content=b"old")).status_code == 200
            loop = asyncio.get_running_loop()

            def overwrite() -> None:  # on the read's thread, while its lookup is done
                put = client.put(f"{FILES}/files/hot.txt", content=b"new")
                asyncio.run_coroutine_threadsafe(put, loop).result(10)

            blobs.before_open = overwrite
            read = await client.get(f"{FILES}/files/hot.txt")
            assert read.status_code == 200, read.text
            assert read.content == b"new"
            assert read.headers["X-Ember-Digest"].startswith("sha256:")

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_file_removed_before_its_content_opens_is_not_found(
    tmp_path: Path, open_store: StoreOpener
) -> None:
    store = open_store()

    async def scenario() -> None:
        client, blobs = _serve(tmp_path, store)
        async with client:
            await client.put(f"{FILES}/files/gone.txt", content=b"x")
            loop = asyncio.get_running_loop()

            def remove() -> None:
                delete = client.delete(f"{FILES}/files/gone.txt")
                asyncio.run_coroutine_threadsafe(delete, loop).result(10)

            blobs.before_open = remove
            read = await client.get(f"{FILES}/files/gone.txt")
            assert read.status_code == 404
            assert "has no file gone.txt" in read.json()["error"]["message"]

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_listings_come_in_pages_after_a_path(tmp_path: Path, open_store: StoreOpener) -> None:
    store = open_store()

    async def scenario() -> None:
        client, _ = _serve(tmp_path, store)
        async with client:
            for path in ("a/1", "a/2", "a/3", "b", "c/é"):
                await client.put(f"{FILES}/files/{path}", content=path.encode())

            async def page(**params: str) -> tuple[list[str], bool]:
                answer = await client.get(FILES, params=params)
                assert answer.status_code == 200, answer.text
                body = answer.json()
                return [f["path"] for f in body["files"]], body["truncated"]

            assert await page(limit="2") == (["a/1", "a/2"], True)
            assert await page(limit="2", after="a/2") == (["a/3", "b"], True)
            assert await page(limit="2", after="b") == (["c/é"], False)
            assert await page(after="c/é") == ([], False)
            assert await page(prefix="a", after="a/1") == (["a/2", "a/3"], False)
            assert await page() == (["a/1", "a/2", "a/3", "b", "c/é"], False)
            for bad in ("0", "-1", "x", "100001"):
                assert (await client.get(FILES, params={"limit": bad})).status_code == 400

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_uploads_of_interrupted_writes_are_swept_and_files_are_kept(
    tmp_path: Path, open_store: StoreOpener
) -> None:
    store = open_store()
    tokens = TokenRegistry(store)
    blobs = LocalBlobStore(tmp_path / "blobs")
    api = VolumesApi(Tenancy(tokens, WorkspaceRegistry(store)), store, blobs)
    app = Starlette(routes=api.routes(), exception_handlers=ERROR_HANDLERS)
    headers = {"Authorization": f"Bearer {tokens.create(Scope.ADMIN, 'test')}"}

    async def write() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp") as client:
            answer = await client.put(f"{FILES}/files/kept.txt", content=b"kept", headers=headers)
            return answer.status_code

    assert asyncio.run(write()) == 200
    blobs.put("volumes/uploads/left-by-a-crash", b"half a file")
    assert api.sweep_uploads() == 0  # a write in flight could still own it
    assert api.sweep_uploads(now=time.time() + 2 * 86400) == 1
    assert blobs.listing("volumes/uploads/") == []
    contents = [key for key, _ in blobs.listing("volumes/")]
    assert len(contents) == 1 and contents[0].startswith("volumes/sha256-")
    assert blobs.get(contents[0]) == b"kept"
