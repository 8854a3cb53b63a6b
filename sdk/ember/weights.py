"""Weights by URL, read lazily through the node's tiered cache.

    view = ember.weights.open("s3://bucket/model.safetensors")   # reads the header only
    view.keys(), view.shapes, view.dtypes, view.metadata           # free
    view["lm_head.weight"]                                          # fetches that tensor
    view.load_into(model)                                           # streams, file order

In a class endpoint, `weights={"model": URL}` makes the same view `self.weights["model"]`.
URLs: s3://bucket/key, s3://bucket/prefix/ (a sharded checkpoint with its
model.safetensors.index.json), https://, http:// and file://. S3 credentials and endpoint
come from the usual AWS settings (or `s3_endpoint_url`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from ember.errors import ConfigError

if TYPE_CHECKING:
    from ember_worker.weights.safetensors.view import WeightsView


def open(  # shadows the builtin here only: `ember.weights.open(url)` reads well
    url: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    s3_endpoint_url: str | None = None,
    chunk_bytes: int | None = None,
    concurrency: int | None = None,
    max_request_bytes: int | None = None,
) -> WeightsView:
    """Open the safetensors weights at `url` lazily. `cache_dir` is the node's disk cache
    (default: $EMBER_WEIGHTS_CACHE, in replicas the worker's; else ~/.cache/ember/weights),
    `cache_bytes` its budget. `chunk_bytes` (16 MiB) and `concurrency` (16 requests in
    flight) shape the range requests; against an origin slow to start each answer, one
    request carries up to `max_request_bytes` (64 MiB) of adjacent chunks."""
    try:
        from ember_worker.weights.opener import open_weights
        from ember_worker.weights.reading.options import DEFAULT_OPTIONS
    except ImportError as exc:
        raise ConfigError(
            f"ember.weights needs the worker's packages ({exc.name} is missing): "
            "pip install 'ember[worker]'"
        ) from None
    chosen = {
        "chunk_bytes": chunk_bytes,
        "concurrency": concurrency,
        "max_request_bytes": max_request_bytes,
    }
    options = replace(DEFAULT_OPTIONS, **{k: v for k, v in chosen.items() if v is not None})
    return open_weights(
        url,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        s3_endpoint_url=s3_endpoint_url,
        options=options,
    )
