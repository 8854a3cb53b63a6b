"""Fetch weights objects whole into the node's disk cache: what a snapshot that maps them
needs before it can be restored on a node that lacks them (`mapped_weights`).

The agent runs `python -I -m ember_worker.weights.fill` as the workspace's uid with a
fixed environment of its own, the objects and the replica's environment (its
endpoint's secrets and origin settings, the workspace's cache in EMBER_WEIGHTS_*) as
JSON on stdin ({"objects": [{url, s3_endpoint_url, tag, size}], "env": {...}}): the
variables are set for the origins' clients once the interpreter runs, so none of them
(PYTHONPATH, LD_PRELOAD) chooses what it loads. It
prints one JSON answer: per object the bytes fetched, or that it changed at its origin
since the snapshot, or the error. A process of its own: the agent's event loop and
memory stay out of it, and the clients it builds end with it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.by_scheme import open_origin
from ember_worker.weights.origins.origin import ObjectVersion
from ember_worker.weights.reading.reader import ObjectReader


def fill_object(cache: DiskCache, wanted: dict[str, Any]) -> dict[str, Any]:
    """Fetch one object (`wanted`: url, s3_endpoint_url, tag, size) whole into `cache`."""
    url = str(wanted["url"])
    expected = ObjectVersion(size=int(wanted["size"]), tag=str(wanted["tag"]))
    began = time.monotonic()
    try:
        origin = open_origin(url, s3_endpoint_url=wanted.get("s3_endpoint_url"))
        with ObjectReader(origin, cache) as reader:
            if reader.version != expected:
                return {"url": url, "changed": reader.version.tag}
            if reader.disk_file() is None:
                return {"url": url, "error": "the node's weights cache cannot hold it"}
            before = reader.stats()["origin_bytes"]
            reader.prefetch().result()
            fetched = reader.stats()["origin_bytes"] - before
    except Exception as error:  # reported to the agent, which boots the replica cold
        return {"url": url, "error": f"{type(error).__name__}: {error}"}
    return {"url": url, "fetched_bytes": fetched, "seconds": round(time.monotonic() - began, 3)}


def fill(cache: DiskCache, objects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [fill_object(cache, wanted) for wanted in objects]


def main() -> int:
    from ember_worker.weights.opener import default_cache_bytes, default_cache_dir

    request = json.load(sys.stdin)
    os.environ.update({str(k): str(v) for k, v in request.get("env", {}).items()})
    cache = DiskCache(default_cache_dir(), default_cache_bytes())
    print(json.dumps({"objects": fill(cache, request["objects"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
