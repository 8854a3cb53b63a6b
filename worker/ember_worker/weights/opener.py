"""From a URL to a lazy `WeightsView` read through this node's tiered cache.

A URL ending in "/" (or in ".json") names a sharded checkpoint: its
`model.safetensors.index.json` maps tensors to shard files next to it. Any other URL
names one safetensors file. Every reader opened here is remembered (weakly) so that the
replica can drop their connections before a snapshot and reopen them after a restore.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit

from ember.errors import WeightsFormatError
from ember_worker.identity import WEIGHTS_CACHE_BYTES_ENV, WEIGHTS_CACHE_DIR_ENV
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.by_scheme import open_origin, prepare
from ember_worker.weights.reading.options import DEFAULT_OPTIONS, ReaderOptions
from ember_worker.weights.reading.reader import ObjectReader
from ember_worker.weights.safetensors.safetensors_file import SafetensorsFile
from ember_worker.weights.safetensors.view import WeightsView
from ember_worker.weights.versions import note_read

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_CACHE_BYTES = 50 * 2**30
MAX_INDEX_BYTES = 64 * 2**20

log = logging.getLogger("ember.worker.weights")

_readers: weakref.WeakSet[ObjectReader] = weakref.WeakSet()
_readers_lock = threading.Lock()


def default_cache_dir() -> Path:
    configured = os.environ.get(WEIGHTS_CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "ember" / "weights"


def default_cache_bytes() -> int:
    configured = os.environ.get(WEIGHTS_CACHE_BYTES_ENV)
    return int(configured) if configured else DEFAULT_CACHE_BYTES


def open_weights(
    url: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    s3_endpoint_url: str | None = None,
    options: ReaderOptions = DEFAULT_OPTIONS,
) -> WeightsView:
    """A lazy view of the safetensors weights at `url`: the header (or the shard index)
    is read now, tensors when asked for."""
    # None, not 0, means the default: a budget of 0 keeps nothing on disk.
    budget = default_cache_bytes() if cache_bytes is None else cache_bytes
    # A str is as good as a Path here (the natural thing to pass); "~" means home.
    root = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    disk = DiskCache(root, budget)

    def reader(object_url: str) -> ObjectReader:
        opened = ObjectReader(
            open_origin(object_url, s3_endpoint_url=s3_endpoint_url), disk, options
        )
        with _readers_lock:
            _readers.add(opened)
        # Its version now (its header is read next anyway): a restored replica checks it.
        note_read(object_url, s3_endpoint_url, opened.version)
        return opened

    if not (url.endswith("/") or url.endswith(".json")):
        return WeightsView(SafetensorsFile(reader(url)))
    index_url = url + INDEX_NAME if url.endswith("/") else url
    base = index_url.rsplit("/", 1)[0] + "/"
    index = reader(index_url)
    if index.size > MAX_INDEX_BYTES:
        raise WeightsFormatError(index_url, f"a shard index of {index.size} bytes is not one")
    raw = bytes(index.read(0, index.size))
    index.close()
    return WeightsView.sharded(
        index_url, raw, lambda name: SafetensorsFile(reader(shard_url(base, name)))
    )


def shard_url(base: str, file_name: str) -> str:
    """The URL of shard `file_name` (a file name, as the index gives it) in folder `base`.
    file:// and http(s):// URLs are percent-encoded, so a '#', '%' or '?' in a name is part
    of it, not a fragment or an escape; an s3:// URL holds its key as it is."""
    if urlsplit(base).scheme.lower() == "s3":
        return base + file_name
    return base + quote(file_name, safe="/")


def follow_cache_dir() -> int:
    """After a restore: readers opened before the snapshot keep this node's cache (as
    the restored identity names it) from now on, not the snapshot node's, which may be
    at another path or on no node at all; the number of readers moved."""
    root, moved = default_cache_dir(), 0
    here: DiskCache | None = None
    with _readers_lock:
        readers = list(_readers)
    for reader in readers:
        disk = reader.disk_tier
        if disk is None or disk.root == root:
            continue
        if here is None:
            here = DiskCache(root, default_cache_bytes())
        reader.move_disk_tier(here)
        moved += 1
    return moved


def drop_connections() -> None:
    """Close every open reader's connections: before a snapshot (a dump cannot hold
    network connections) and after a restore (the restored ones are dead). Readers
    reconnect on their next read."""
    with _readers_lock:
        readers = list(_readers)
    for reader in readers:
        reader.reset()


def complete_mapped_objects() -> list[str]:
    """Fetch the rest of every object that a tensor still maps from the node's disk cache
    into that cache, and let go of the readers' own mappings; the URLs completed.

    Run at a replica's quiet point: a snapshot leaves mapped pages of those files out of
    its image, and a restore needs each of them whole on its node (`mapped_weights`),
    which a cold boot on another node makes it there too. A failure only costs
    restores: it is logged."""
    drop_connections()  # the readers' own mappings go: what is left is the tensors'
    gc.collect()  # and views of them that only a reference cycle keeps
    mapped = _mapped_paths()
    with _readers_lock:
        readers = list(_readers)
    completed = []
    for reader in readers:
        cached = reader.disk_file()
        if cached is None or os.path.realpath(cached.data_path) not in mapped:
            continue
        if not cached.missing_bytes():
            continue
        try:
            reader.prefetch().result()
        except Exception as error:  # the replica serves; restores elsewhere boot cold
            log.warning("could not keep all of %s on this node's disk: %s", reader.url, error)
            continue
        completed.append(reader.url)
    if completed:
        drop_connections()
    return completed


def _mapped_paths() -> set[str]:
    """The files this process maps, as /proc names them (symbolic links resolved)."""
    with open("/proc/self/maps") as maps:
        return {
            fields[5] for line in maps if len(fields := line.rstrip("\n").split(maxsplit=5)) == 6
        }


class WeightsByName(Mapping[str, WeightsView]):
    """`self.weights` of a class endpoint: each name of `weights=` opened on first use."""

    def __init__(self, urls: Mapping[str, str], s3_endpoint_url: str | None = None) -> None:
        self._urls = dict(urls)
        self._s3_endpoint_url = s3_endpoint_url
        self._views: dict[str, WeightsView] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> WeightsView:
        if name not in self._urls:
            known = ", ".join(sorted(self._urls)) or "none"
            raise KeyError(f"no weights named {name!r} in weights= (known: {known})")
        with self._lock:
            if name not in self._views:
                self._views[name] = open_weights(
                    self._urls[name], s3_endpoint_url=self._s3_endpoint_url
                )
            return self._views[name]

    def prepare(self) -> None:
        """Import and build the clients the origins of these weights need, contacting none
        (`origins.prepare`); a failure here only leaves that work to the first read."""
        for name, url in self._urls.items():
            try:
                prepare(url, s3_endpoint_url=self._s3_endpoint_url)
            except Exception as error:  # e.g. a client library missing: the read will say
                log.warning("could not prepare the origin of weights %r: %s", name, error)

    def __iter__(self) -> Iterator[str]:
        return iter(self._urls)

    def __len__(self) -> int:
        return len(self._urls)

    def __repr__(self) -> str:
        return f"WeightsByName({self._urls!r})"
