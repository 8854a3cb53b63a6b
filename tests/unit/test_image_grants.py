"""Which workspaces may use an image pulled from a registry (images/grants.py, issue 47):
an image on a Debian base is every workspace's; one on a registry layer only a
workspace's with a grant for that layer as it is stored (its manifest), made after that
workspace was. Against a real folder blob store."""

from __future__ import annotations

import json
from pathlib import Path

from ember_platform.images.blob_keys import grant_key, layer_key
from ember_platform.images.grants import ImageGrants, registry_base
from ember_platform.storage.blobs import LocalBlobStore

BASE = "sha256:" + "a" * 64
ABOVE = {"digest": "sha256:" + "b" * 64, "kind": "run"}
PULLED = [{"digest": BASE, "kind": "registry"}, ABOVE]
MANIFEST = "sha256:" + "c" * 64


def _store(tmp_path: Path, manifest: str | None = MANIFEST) -> LocalBlobStore:
    blobs = LocalBlobStore(tmp_path / "blobs")
    entry = {"sha256": "d" * 64, "size": 1, "kind": "registry"}
    if manifest is not None:
        entry["manifest"] = manifest
    blobs.put(layer_key("a" * 64), json.dumps(entry).encode())
    return blobs


def test_a_debian_base_is_everyones_and_a_pulled_one_its_granted_workspaces(
    tmp_path: Path,
) -> None:
    grants = ImageGrants(_store(tmp_path))
    debian = [{"digest": BASE, "kind": "debian_slim"}, ABOVE]
    assert registry_base(debian) is None and registry_base(PULLED) == BASE
    assert grants.holds("bravo", 5.0, debian)
    assert not grants.holds("alpha", 5.0, PULLED)
    grants.add("alpha", 5.0, PULLED)
    assert grants.holds("alpha", 5.0, PULLED)
    assert not grants.holds("bravo", 5.0, PULLED)  # another workspace
    assert not grants.holds("alpha", 6.0, PULLED)  # alpha removed and made again


def test_a_layer_pulled_again_or_dropped_holds_no_earlier_grant(tmp_path: Path) -> None:
    blobs = _store(tmp_path)
    grants = ImageGrants(blobs)
    grants.add("alpha", 0.0, PULLED)
    _store(tmp_path, "sha256:" + "e" * 64)  # pulled again: the tag names another manifest
    assert not grants.holds("alpha", 0.0, PULLED)
    grants.add("alpha", 0.0, PULLED)
    assert grants.holds("alpha", 0.0, PULLED)
    grants.drop_layer("a" * 64)
    assert not blobs.exists(grant_key("a" * 64, "alpha"))
    blobs.delete(layer_key("a" * 64))
    grants.add("alpha", 0.0, PULLED)  # nothing stored to grant
    assert not blobs.exists(grant_key("a" * 64, "alpha"))


def test_a_layer_stored_before_manifests_were_kept_is_granted_as_stored(tmp_path: Path) -> None:
    grants = ImageGrants(_store(tmp_path, manifest=None))
    assert not grants.holds("alpha", 0.0, PULLED)
    grants.add("alpha", 0.0, PULLED)
    assert grants.holds("alpha", 0.0, PULLED)
