"""Which workspaces may use an image pulled from a registry: its first layer holds what
the registry gave for credentials of one workspace, and every layer above is built on
it, so reusing any of them is reading the registry with those credentials. A workspace
gets a grant for the pulled layer once a build of its own, with its own secret, pulled
it or had the registry accept its credentials for the manifest that was pulled
(`ember_worker.images.builder`, `verify_registry`); until then the image is not built
for it (build API, deploys) and its build goes to a node, which checks with the
registry before it reuses anything.

Layers on a Debian base are shared by every workspace: they hold nothing a definition
(apt and pip lines, commands, files by their contents' digest) does not give.

A grant is `image-grants/<layer hex>/<workspace>.json` in the blob store (shared by the
control-plane processes): the manifest digest it was given for, and when the workspace
was made, so that a layer pulled again from another manifest, or a workspace removed and
made again under the same name, holds none."""

from __future__ import annotations

import json
from typing import Any

from ember.wire.labels import MAIN_WORKSPACE
from ember_platform.images.blob_keys import GRANTS, grant_key, layer_key
from ember_platform.security.workspaces import WorkspaceRegistry
from ember_platform.storage.blobs import BlobStore


def registry_base(steps: list[dict[str, Any]]) -> str | None:
    """The digest of the registry layer an image (its steps, or its record's layers)
    is built on, or None for an image on a Debian base."""
    first = steps[0] if steps else {}
    return str(first["digest"]) if first.get("kind") == "registry" else None


def made_at(workspaces: WorkspaceRegistry, name: str) -> float:
    """When workspace `name` was made: 0 for main (never removed; its time is the
    process's start), -1 for one unknown here."""
    if name == MAIN_WORKSPACE:
        return 0.0
    return next((w.created_at for w in workspaces.all() if w.name == name), -1.0)


class ImageGrants:
    """Blocking calls (the blob store's): run them in a thread from the event loop."""

    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs

    def _manifest(self, hex_digest: str) -> str | None:
        """The manifest digest the stored layer was pulled from ('' for a layer stored
        before they were recorded), or None when it is not stored."""
        data = self.blobs.get(layer_key(hex_digest))
        if data is None:
            return None
        return str(json.loads(data).get("manifest") or "")

    def holds(self, workspace: str, created_at: float, steps: list[dict[str, Any]]) -> bool:
        """Whether `workspace` may use an image of `steps`: always on a Debian base."""
        base = registry_base(steps)
        if base is None:
            return True
        hex_digest = base.removeprefix("sha256:")
        data = self.blobs.get(grant_key(hex_digest, workspace))
        if data is None:
            return False
        grant = json.loads(data)
        return grant.get("created_at") == created_at and self._manifest(hex_digest) == grant.get(
            "manifest"
        )

    def add(self, workspace: str, created_at: float, steps: list[dict[str, Any]]) -> None:
        """`workspace` may use the image's registry layer as it is stored now (a build of
        its own pulled it, or checked it with the registry)."""
        base = registry_base(steps)
        if base is None:
            return
        hex_digest = base.removeprefix("sha256:")
        manifest = self._manifest(hex_digest)
        if manifest is None:
            return  # dropped meanwhile: nothing to grant
        grant = {"manifest": manifest, "created_at": created_at}
        self.blobs.put(grant_key(hex_digest, workspace), json.dumps(grant).encode())

    def drop_layer(self, hex_digest: str) -> None:
        """A registry layer's grants, with the layer: whoever pulls it again is the only
        one to hold one."""
        for key, _ in self.blobs.listing(f"{GRANTS}{hex_digest}/"):
            self.blobs.delete(key)
