"""`PUT /v1/bundles/{digest}` applies the worker's bundle rules before storing anything,
and a deployment's manifest entry must be a path inside the bundle: the control plane's
deploy API served in this process, with a real store, cluster and blob store."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import tarfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from cluster_harness import make_env
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.wire.bundle_rules import MAX_EXPANDED_BYTES, MAX_FILES
from ember_platform.api.deploys import DeploysApi, bundle_key
from ember_platform.api.workspaces import Tenancy
from ember_platform.edge.errors import HttpError, http_error
from ember_platform.errors import PlatformError
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.security.workspaces import WorkspaceRegistry
from ember_platform.storage.blobs import LocalBlobStore

# Name, tar type, data (or a link's target; or for ZEROS, how many zero bytes).
Member = tuple[str, bytes, bytes]
ZEROS = b"zeros"


async def _http_error(request: Request, error: Exception) -> Response:
    if not isinstance(error, HttpError | PlatformError):
        raise error
    exc = http_error(error)
    return Response(exc.body(), exc.status, exc.headers, media_type="application/json")


def _bundle(*members: Member) -> bytes:
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == ZEROS:
                info.type, info.size = tarfile.REGTYPE, int(data)
                with open("/dev/zero", "rb") as zeros:  # read as far as the size says
                    tar.addfile(info, zeros)
            elif kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.linkname = data.decode()
                tar.addfile(info)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x = 1\n") -> Member:
    return name, tarfile.REGTYPE, data


APP = _file("app.py")


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


Scenario = Callable[[httpx.AsyncClient, LocalBlobStore], Awaitable[None]]


def _serve(tmp_path: Path, scenario: Scenario) -> None:
    async def main() -> None:
        env = make_env(tmp_path / "cp")
        tokens = TokenRegistry(env.store)
        token = tokens.create(Scope.ADMIN, "test")
        blobs = LocalBlobStore(tmp_path / "blobs")
        tenancy = Tenancy(tokens, WorkspaceRegistry(env.store))
        api = DeploysApi(tenancy, env.cluster, blobs, "https://cp")
        routes = [
            Route("/v1/bundles/{digest}", api.put_bundle, methods=["PUT"]),
            Route("/v1/apps/{app}/deployments", api.deploy, methods=["POST"]),
        ]
        app = Starlette(
            routes=routes, exception_handlers={HttpError: _http_error, PlatformError: _http_error}
        )
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://cp",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            async with client:
                await scenario(client, blobs)
        finally:
            env.store.close()

    asyncio.run(main())


async def _refused(
    client: httpx.AsyncClient, blobs: LocalBlobStore, data: bytes, status: int
) -> str:
    digest = _digest(data)
    response = await client.put(f"/v1/bundles/{digest}", content=data)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == ("payload_too_large" if status == 413 else "invalid_request")
    assert not blobs.exists(bundle_key(digest))  # nothing stored
    return str(error["message"])


def test_hostile_bundles_are_refused_at_upload_naming_the_member(tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient, blobs: LocalBlobStore) -> None:
        cases = {
            "'../x' escapes the bundle folder": [APP, _file("../x")],
            "'/etc/x' is an absolute path": [APP, _file("/etc/x")],
            "'evil' is a symbolic link to '/etc/passwd'": [
                APP,
                ("evil", tarfile.SYMTYPE, b"/etc/passwd"),
            ],
            "'evil' is a hard link to 'app.py'": [APP, ("evil", tarfile.LNKTYPE, b"app.py")],
        }
        for message, members in cases.items():
            assert message in await _refused(client, blobs, _bundle(*members), 400)
        many = _bundle(*(_file(f"m/{i}.py", b"") for i in range(25_000)))
        said = await _refused(client, blobs, many, 400)
        assert f"more than {MAX_FILES} members (at 'm/{MAX_FILES}.py')" in said
        # File data past the cap, in a small upload (zeros compress about 1000 times).
        zeros = _bundle(APP, ("zeros.bin", ZEROS, str(MAX_EXPANDED_BYTES).encode()))
        assert len(zeros) < MAX_EXPANDED_BYTES // 500
        said = await _refused(client, blobs, zeros, 413)
        assert f"'zeros.bin' takes the bundle over {MAX_EXPANDED_BYTES} bytes" in said

    _serve(tmp_path, scenario)


def test_a_good_bundle_is_stored_and_deploys(tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient, blobs: LocalBlobStore) -> None:
        data = _bundle(("pkg", tarfile.DIRTYPE, b""), APP, _file("pkg/__init__.py", b""))
        digest = _digest(data)
        response = await client.put(f"/v1/bundles/{digest}", content=data)
        assert response.status_code == 201, response.text
        assert blobs.get(bundle_key(digest)) == data
        manifest = {"entry": "app.py", "endpoints": []}
        deploy = {"manifest": manifest, "bundle_digest": digest}
        # Past the entry check: an app with no endpoints is refused for that instead.
        response = await client.post("/v1/apps/a/deployments", json=deploy)
        assert response.status_code == 400
        assert "defines no @ember.endpoint" in response.json()["error"]["message"]
        for entry in ("../x.py", "/abs.py"):
            deploy["manifest"] = {**manifest, "entry": entry}
            response = await client.post("/v1/apps/a/deployments", json=deploy)
            assert response.status_code == 400, response.text
            assert f"entry '{entry}'" in response.json()["error"]["message"]

    _serve(tmp_path, scenario)
