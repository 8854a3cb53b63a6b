"""`Image.from_registry`: an OCI image pulled through the OCI distribution API (or
Docker's v2, the same API): its manifest (from an index, the node's platform), its
config (environment and working folder) and its layers, each checked against its
digest, then applied in order into one tree that becomes the image's first layer.

Credentials: a username and password (from the step's secret) answer a Basic challenge,
or are sent to the token service a Bearer challenge names (Docker Hub, GHCR, most
registries); without any, anonymous tokens are asked for. A registry on the loopback
interface is spoken to over plain HTTP (as Docker does), any other over HTTPS.

The digest of the manifest a pull starts from is kept with its layer: a layer pulled with
one workspace's credentials is reused by another only once the registry has served that
manifest to the other's credentials (`check_access`)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import platform
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zstandard

from ember.errors import InvalidError
from ember.images.checks import check_remote_path
from ember.images.references import Reference, parse_reference
from ember_worker.images.oci_layers import apply_layer

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
ACCEPT = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
INDEXES = (OCI_INDEX, DOCKER_LIST)
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
ARCHES = {"x86_64": "amd64", "aarch64": "arm64"}
CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
MAX_MANIFEST = 4 * 1024 * 1024


class RegistryError(Exception):
    pass


@dataclass
class PulledConfig:
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    manifest: str = ""  # the digest of the manifest (or index) the reference named


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class RegistryClient:
    def __init__(self, reference: Reference, credentials: tuple[str, str] | None) -> None:
        self.reference = reference
        self.credentials = credentials
        registry = reference.registry
        host = registry[: registry.index("]") + 1] if registry.startswith("[") else registry
        host = host.split(":")[0] if not host.startswith("[") else host
        scheme = "http" if host in LOOPBACK else "https"
        self.base = f"{scheme}://{reference.registry}/v2/{reference.repository}"
        self.client = httpx.Client(timeout=httpx.Timeout(30.0, read=300.0), follow_redirects=True)
        self.authorization: str | None = None
        self.digest = ""  # of the first manifest fetched: the one the reference names

    def close(self) -> None:
        self.client.close()

    def _send(self, path: str, accept: str | None = None) -> httpx.Response:
        headers = {"Accept": accept} if accept else {}
        for attempt in range(2):
            if self.authorization:
                headers["Authorization"] = self.authorization
            request = self.client.build_request("GET", self.base + path, headers=headers)
            try:
                response = self.client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise RegistryError(f"{self.reference.registry}: {exc}") from None
            if response.status_code != 401 or attempt == 1:
                return response
            challenge = response.headers.get("www-authenticate", "")
            response.close()
            self._authorize(challenge)
        raise AssertionError("unreachable")  # the loop returns on its second pass

    def _authorize(self, challenge: str) -> None:
        """Answer a 401's challenge: Basic with the credentials, or a Bearer token from
        the service it names (with the credentials, if any)."""
        scheme = challenge.split(" ", 1)[0].lower()
        if scheme == "basic":
            if self.credentials is None:
                raise RegistryError(
                    f"{self.reference.registry} wants a username and password: give "
                    "from_registry(..., secret=NAME), a secret with REGISTRY_USERNAME and "
                    "REGISTRY_PASSWORD"
                )
            pair = f"{self.credentials[0]}:{self.credentials[1]}".encode()
            self.authorization = "Basic " + base64.b64encode(pair).decode()
            return
        if scheme != "bearer":
            raise RegistryError(f"{self.reference.registry}: unknown challenge {challenge!r}")
        fields = dict(CHALLENGE.findall(challenge))
        realm = fields.pop("realm", "")
        if not realm.startswith(("https://", "http://")):
            raise RegistryError(f"{self.reference.registry}: no token service in {challenge!r}")
        auth = httpx.BasicAuth(*self.credentials) if self.credentials else None
        try:
            answer = self.client.get(realm, params=fields, auth=auth)
        except httpx.HTTPError as exc:
            raise RegistryError(f"token service {realm}: {exc}") from None
        if answer.status_code != 200:
            raise RegistryError(
                f"token service {realm} refused {'the credentials' if auth else 'anonymous access'}"
                f" (HTTP {answer.status_code})"
            )
        body = answer.json()
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not token:
            raise RegistryError(f"token service {realm} gave no token")
        self.authorization = f"Bearer {token}"

    def _fail(self, response: httpx.Response, what: str) -> RegistryError:
        response.read()
        if response.status_code == 401:
            return RegistryError(f"{self.reference}: the registry refused the credentials")
        if response.status_code == 404:
            return RegistryError(f"{self.reference}: the registry has no {what}")
        return RegistryError(f"{self.reference}: {what}: HTTP {response.status_code}")

    def _manifest_at(self, wanted: str) -> tuple[dict[str, Any], str]:
        response = self._send(f"/manifests/{wanted}", ACCEPT)
        if response.status_code != 200:
            what = "such manifest" if wanted.startswith("sha256:") else f"tag {wanted!r}"
            raise self._fail(response, what)
        body = response.read()[: MAX_MANIFEST + 1]
        if len(body) > MAX_MANIFEST:
            raise RegistryError(f"{self.reference}: the manifest is over 4 MiB")
        if wanted.startswith("sha256:") and _sha256(body) != wanted:
            raise RegistryError(
                f"{self.reference}: the manifest the registry sent has digest "
                f"{_sha256(body)}, not {wanted}"
            )
        self.digest = self.digest or _sha256(body)
        data = json.loads(body)
        media = data.get("mediaType") or response.headers.get("content-type", "")
        return data, media

    def manifest(self) -> dict[str, Any]:
        """The image's manifest, from an index the one of this node's platform."""
        data, media = self._manifest_at(self.reference.wanted)
        if media in INDEXES or "manifests" in data:
            arch = ARCHES.get(platform.machine(), platform.machine())
            chosen = [
                m
                for m in data.get("manifests", [])
                if m.get("platform", {}).get("os") == "linux"
                and m.get("platform", {}).get("architecture") == arch
            ]
            if not chosen:
                raise RegistryError(f"{self.reference}: no image for linux/{arch} in its index")
            data, media = self._manifest_at(chosen[0]["digest"])
        if not isinstance(data.get("layers"), list) or "config" not in data:
            raise RegistryError(f"{self.reference}: {media or 'the manifest'} is not an image's")
        return data

    def blob(self, digest: str, target: Path) -> None:
        """A blob into `target`, checked against its digest."""
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(digest)):
            raise RegistryError(f"{self.reference}: {digest!r} is not a sha256 digest")
        response = self._send(f"/blobs/{digest}")
        if response.status_code != 200:
            raise self._fail(response, f"blob {digest}")
        hasher = hashlib.sha256()
        with target.open("wb") as out:
            for chunk in response.iter_bytes(4 * 1024 * 1024):
                hasher.update(chunk)
                out.write(chunk)
        response.close()
        if "sha256:" + hasher.hexdigest() != digest:
            raise RegistryError(f"{self.reference}: blob {digest} arrived with another digest")


def _plain_tar(blob: Path, media: str, target: Path) -> None:
    """A layer blob as an uncompressed tar (gzip and zstd are what registries hold)."""
    with blob.open("rb") as source, target.open("wb") as out:
        if media.endswith("gzip"):
            with gzip.open(source) as unzipped:
                shutil.copyfileobj(unzipped, out, 4 * 1024 * 1024)
        elif media.endswith("zstd"):
            zstandard.ZstdDecompressor().copy_stream(source, out)
        else:
            shutil.copyfileobj(source, out, 4 * 1024 * 1024)
        # Some tools (umoci 0.4) end a layer right after its last file's bytes, without
        # the padding to a 512-byte block and the end blocks; readers of Go's archive/tar
        # take that, Python's tarfile does not: pad it.
        out.write(b"\0" * (-out.tell() % 512 + 1024))


def pull(
    reference_text: str,
    credentials: tuple[str, str] | None,
    tree: Path,
    scratch: Path,
    on_line: Callable[[str], None],
) -> PulledConfig:
    """The image's layers applied in order into `tree`; its config's environment and
    working folder."""
    reference = parse_reference(reference_text)
    client = RegistryClient(reference, credentials)
    try:
        manifest = client.manifest()
        config_blob = scratch / "config.json"
        client.blob(manifest["config"]["digest"], config_blob)
        config = json.loads(config_blob.read_text()).get("config") or {}
        layers = manifest["layers"]
        tree.mkdir(parents=True, exist_ok=True)
        for number, layer in enumerate(layers, start=1):
            on_line(
                f"layer {number}/{len(layers)}: {layer['digest'][7:19]}, "
                f"{int(layer.get('size', 0)) / 1e6:.1f} MB"
            )
            blob, plain = scratch / "layer.blob", scratch / "layer.tar"
            client.blob(layer["digest"], blob)
            _plain_tar(blob, str(layer.get("mediaType", "")), plain)
            blob.unlink()
            apply_layer(plain, tree)
            plain.unlink()
    finally:
        client.close()
    env = {}
    for item in config.get("Env") or []:
        key, _, value = str(item).partition("=")
        if key:
            env[key] = value
    try:  # the registry's: a '..' would lead root out of the image where it makes it
        workdir = check_remote_path("the image's WorkingDir", config.get("WorkingDir") or "/")
    except InvalidError as exc:
        raise RegistryError(str(exc)) from None
    return PulledConfig(env=env, workdir=workdir, manifest=client.digest)


def check_access(reference_text: str, credentials: tuple[str, str] | None, manifest: str) -> str:
    """Have the registry serve the manifest `manifest` (a digest; '' for a layer stored
    before digests were kept: the one the reference names) to `credentials`: a
    RegistryError if it refuses them or has no such manifest. The digest it served."""
    reference = parse_reference(reference_text)
    client = RegistryClient(reference, credentials)
    try:
        client._manifest_at(manifest or reference.wanted)  # its bytes checked if a digest
    finally:
        client.close()
    return client.digest
