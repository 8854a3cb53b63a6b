"""Collection of images' blobs in the store (api/images.py and api/image_builds.py name
them): what no built image names goes once it is old enough.

- Layers that no image record names (a failed build's, kept so that a retry starts at
  the failed step; an interrupted build's) go after `LAYER_MAX_AGE`: their entry
  (`image-layers/`), then their tar (`image-blobs/`) unless a kept layer or a record
  names it. Tars no entry or record names (an upload cut short, an image's file index
  replaced) likewise, by their own age. A running build's layers are kept whatever
  their age.
- Uploaded local files (`image-files/`, one tar per copy step) go when their build
  ends (`files_after_build`), unless uploaded again since it began (another deploy of
  the same files is about to ask for a build); those no build used, after
  `FILES_MAX_AGE`.

`unnamed_blobs` is the policy, pure; `ImageBlobGarbage` runs it against the store in a
thread, on the owner's controller every few minutes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from ember_platform.images.blob_keys import BLOBS, FILES, HEX, LAYERS, RECORDS, files_key
from ember_platform.storage.blobs import BlobStore

log = logging.getLogger("ember.images")

LAYER_MAX_AGE = 7 * 86400.0
FILES_MAX_AGE = 86400.0


@dataclass(frozen=True)
class StoredImages:
    """What the store holds of images: records, layer entries (hex digest -> (entry,
    written)), layer tars and uploaded files (key -> written)."""

    records: list[dict[str, Any]]
    layers: dict[str, tuple[dict[str, Any], float]]
    tars: dict[str, float]
    files: dict[str, float]


def unnamed_blobs(
    stored: StoredImages,
    *,
    now: float,
    building_layers: AbstractSet[str] = frozenset(),
    building_files: AbstractSet[str] = frozenset(),
    layer_max_age: float = LAYER_MAX_AGE,
    files_max_age: float = FILES_MAX_AGE,
) -> list[str]:
    """The keys to delete, layer entries before tars. `building_layers`: digests
    (sha256:...) of the layers of images being built; `building_files`: the sha256s of
    their uploaded files."""
    named = set(building_layers)
    kept_tars: set[str] = set()
    for record in stored.records:
        for layer in record.get("layers") or []:
            named.add(str(layer.get("digest", "")))
            kept_tars.add(str(layer.get("sha256", "")))
        index = record.get("lazy_index")
        if isinstance(index, dict):
            kept_tars.add(str(index.get("sha256", "")))
    doomed: list[str] = []
    for hex_digest, (entry, written) in sorted(stored.layers.items()):
        if "sha256:" + hex_digest in named or now - written < layer_max_age:
            kept_tars.add(str(entry.get("sha256", "")))
        else:
            doomed.append(LAYERS + hex_digest + ".json")
    for key, written in sorted(stored.tars.items()):
        name = key.removeprefix(BLOBS)
        if name not in kept_tars and now - written >= layer_max_age:
            doomed.append(key)
    for key, written in sorted(stored.files.items()):
        name = key.removeprefix(FILES)
        if name not in building_files and now - written >= files_max_age:
            doomed.append(key)
    return doomed


def read_stored(blobs: BlobStore) -> StoredImages:
    """Every record, layer entry, tar and uploaded file in the store (blocking). The
    entries of layers a record names are not read (the record names their tars)."""
    records = []
    for key, _ in blobs.listing(RECORDS):
        data = blobs.get(key)
        if data is not None:
            records.append(json.loads(data))
    named = {str(layer.get("digest")) for r in records for layer in r.get("layers") or []}
    layers: dict[str, tuple[dict[str, Any], float]] = {}
    for key, written in blobs.listing(LAYERS):
        hex_digest = key.removeprefix(LAYERS).removesuffix(".json")
        if not HEX.match(hex_digest):
            continue
        if "sha256:" + hex_digest in named:
            layers[hex_digest] = ({}, written)
        elif (data := blobs.get(key)) is not None:
            layers[hex_digest] = (json.loads(data), written)
    return StoredImages(records, layers, dict(blobs.listing(BLOBS)), dict(blobs.listing(FILES)))


class ImageBlobGarbage:
    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs
        self._task: asyncio.Task[list[str]] | None = None
        self._deletes: set[asyncio.Task[None]] = set()

    def collect_soon(self, building_layers: Iterable[str], building_files: Iterable[str]) -> None:
        """collect() in the background, unless one runs (the controller's loop; a
        tick called outside one, as unit tests do, collects nothing)."""
        if self._task is not None and not self._task.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = asyncio.ensure_future(
            asyncio.to_thread(self.collect, set(building_layers), set(building_files))
        )

    def collect(self, building_layers: set[str], building_files: set[str]) -> list[str]:
        """Delete what no built image names and is old enough (blocking); the keys."""
        try:
            stored = read_stored(self.blobs)
        except Exception as error:  # the store unreachable, a record unreadable
            log.warning("image blobs not collected: %s", error)
            return []
        doomed = unnamed_blobs(
            stored,
            now=time.time(),
            building_layers=building_layers,
            building_files=building_files,
        )
        deleted = []
        for key in doomed:
            try:
                self.blobs.delete(key)
            except Exception as error:  # a bucket's error: tried again in 5 minutes
                log.warning("image blob %s not deleted: %s", key, error)
            else:
                deleted.append(key)
        if deleted:
            log.info("collected %d image blob(s) no built image names", len(deleted))
        return deleted

    def files_after_build(self, sha256s: Iterable[str], started_at: float) -> None:
        """The uploaded files of a build that ended, in the background: each unless
        uploaded again since the build began."""

        def delete() -> None:
            try:
                listed = dict(self.blobs.listing(FILES))  # a folder's or a bucket's prefix
                for sha256 in sha256s:
                    key = files_key(sha256)
                    if key in listed and listed[key] < started_at:
                        self.blobs.delete(key)
            except Exception as error:  # left for the age limit
                log.warning("a build's uploaded files not deleted: %s", error)

        task = asyncio.ensure_future(asyncio.to_thread(delete))
        self._deletes.add(task)  # kept until done
        task.add_done_callback(self._deletes.discard)
