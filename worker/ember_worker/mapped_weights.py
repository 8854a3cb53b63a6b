"""Weights a snapshot maps instead of holding: files of the node's weights cache that the
dumped replica still had mapped (tensors from `state_dict()`, kept in `enter(snap=True)`).

CRIU leaves a private file mapping's unwritten pages out of the image and maps the file
again at restore, so the image is smaller by the weights and a restore reads them from
the page cache without a copy. In exchange a restore needs each file at the same path,
of the same size, and whole (every byte fetched): the worker fetches the rest of each at
the quiet point (`opener.complete_mapped_objects`), and a node whose cache lacks one
boots cold instead, which fills its cache for the next restore.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ember_worker.weights.disk_object import DATA_SUFFIX, missing_bytes


class WeightsNotOnNode(Exception):
    """A snapshot maps a weights file this node's cache does not hold whole."""


def find(paths: Iterable[str], objects_dir: Path) -> list[dict[str, Any]]:
    """The data files of the cache at `objects_dir` among `paths` (the files a process
    maps or holds open), with their sizes, for the image's metadata."""
    objects_dir = objects_dir.resolve()  # /proc names files with links resolved
    found = []
    for text in sorted(paths):
        path = Path(text)
        if path.parent != objects_dir or path.suffix != DATA_SUFFIX:
            continue
        try:
            size = os.stat(path).st_size
        except OSError:  # evicted meanwhile: CRIU will say so if it matters
            continue
        found.append({"path": text, "size": size})
    return found


def check_on_node(mapped: Sequence[dict[str, Any]], objects_dir: Path) -> None:
    """Raise WeightsNotOnNode unless every file of `mapped` (`find`'s entries) is in the
    cache at `objects_dir` with its size and every byte."""
    objects_dir = objects_dir.resolve()
    for entry in mapped:
        path, size = Path(str(entry["path"])), int(entry["size"])
        if path.parent != objects_dir:
            raise WeightsNotOnNode(f"it maps {path}, outside this node's weights cache")
        try:
            on_disk = os.stat(path).st_size
        except OSError:
            raise WeightsNotOnNode(
                f"it maps weights this node's cache does not hold ({path.name})"
            ) from None
        if on_disk != size:
            raise WeightsNotOnNode(f"{path.name} is {on_disk} bytes here, {size} in the image")
        missing = missing_bytes(path, size)
        if missing:
            raise WeightsNotOnNode(
                f"this node's cache lacks {missing / 1e6:.1f} MB of {path.name}, which it maps"
            )


def total_bytes(mapped: Sequence[dict[str, Any]]) -> int:
    return sum(int(entry["size"]) for entry in mapped)
