"""An image's file index in the control plane's store, made once per cluster: stored as
a blob by its sha256 and named in the image's record (`lazy_index`). The node that
builds the image makes it (`ensure_index` after the build); any node that finds a record
without one makes it then. Making it reads each layer tar once, as a stream, from the
store; a node keeps the indexes it used under its folder. Blocking calls."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from ember_worker.images.layer_store import LayerStore, LayerStoreError
from ember_worker.images.lazy.file_index import FileIndex, UnindexableImage, index_layers

RECORD_FIELD = "lazy_index"


class _ResponseStream:
    """A file-like `read(n)` over a streamed HTTP body."""

    def __init__(self, response: httpx.Response) -> None:
        self._chunks = response.iter_bytes(1024 * 1024)
        self._buffer = bytearray()
        self._done = False

    def read(self, size: int = -1) -> bytes:
        while not self._done and (size < 0 or len(self._buffer) < size):
            try:
                self._buffer += next(self._chunks)
            except StopIteration:
                self._done = True
        if size < 0:
            size = len(self._buffer)
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data


@contextmanager
def _layer_stream(store: LayerStore, sha256: str) -> Iterator[_ResponseStream]:
    path = f"/v1/image-blobs/sha256:{sha256}"
    try:
        with store.client.stream("GET", path) as response:
            if response.status_code != 200:
                raise LayerStoreError(f"GET {path}: HTTP {response.status_code}")
            yield _ResponseStream(response)
    except httpx.HTTPError as error:
        raise LayerStoreError(f"GET {path}: {error}") from None


def make_index(store: LayerStore, record: dict[str, Any]) -> FileIndex:
    """The index of the image `record` describes, from its layer tars in the store."""
    with ExitStack() as stack:
        layers = (
            (layer["sha256"], stack.enter_context(_layer_stream(store, layer["sha256"])))
            for layer in record["layers"]
        )
        return index_layers(layers)


def ensure_index(store: LayerStore, digest: str, folder: Path) -> tuple[FileIndex, Path]:
    """The image's index and its file on this node (under `folder`): the one its record
    names, else one made now, stored, and named in its record."""
    path, made = _index_file(store, digest, folder)
    return (made or FileIndex.from_bytes(path.read_bytes())), path


def index_file(store: LayerStore, digest: str, folder: Path) -> Path:
    """As `ensure_index`, the file alone (a mount reads it; the agent need not)."""
    return _index_file(store, digest, folder)[0]


def _index_file(store: LayerStore, digest: str, folder: Path) -> tuple[Path, FileIndex | None]:
    record = store.record(digest)
    if record is None:
        raise LayerStoreError(f"image {digest} is not built")
    folder.mkdir(parents=True, exist_ok=True)
    named = record.get(RECORD_FIELD)
    if isinstance(named, dict) and isinstance(named.get("sha256"), str):
        path = folder / f"{named['sha256']}.zst"
        if not path.exists():
            _fetch(store, named["sha256"], path)
        return path, None
    index = make_index(store, record)
    raw = index.to_bytes()
    sha256 = hashlib.sha256(raw).hexdigest()
    path = folder / f"{sha256}.zst"
    _write(path, raw)
    _put_blob(store, sha256, raw)
    store.put_record(digest, {**record, RECORD_FIELD: {"sha256": sha256, "size": len(raw)}})
    return path, index


def index_after_build(
    store: LayerStore, digest: str, folder: Path, on_line: Callable[[str], None]
) -> None:
    """Make the index of an image just built, so that no node waits for it at a
    replica's start; one that cannot be made leaves the image to be extracted."""
    began = time.monotonic()
    try:
        index, _ = ensure_index(store, digest, folder)
    except UnindexableImage as exc:
        on_line(f"file index: none ({exc}); replicas extract the image")
        return
    on_line(
        f"file index: {len(index.inodes)} inodes, {index.file_bytes() / 1e6:.0f} MB of files, "
        f"in {time.monotonic() - began:.1f} s"
    )


def _fetch(store: LayerStore, sha256: str, path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        temp = Path(scratch) / "index"
        store.fetch_tar(sha256, temp)  # checked against its sha256
        os.replace(temp, path)


def _put_blob(store: LayerStore, sha256: str, raw: bytes) -> None:
    path = f"/v1/image-blobs/sha256:{sha256}"
    try:
        response = store.client.put(path, content=raw)
    except httpx.HTTPError as error:
        raise LayerStoreError(f"PUT {path}: {error}") from None
    if response.status_code != 201:
        raise LayerStoreError(f"PUT {path}: HTTP {response.status_code} {response.text[:200]}")


def _write(path: Path, raw: bytes) -> None:
    descriptor, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(descriptor, "wb") as out:
        out.write(raw)
    os.replace(temp, path)
