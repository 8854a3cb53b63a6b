"""Weights a snapshot maps instead of holding: files of the node's weights cache that the
dumped replica still had mapped (tensors from `state_dict()`, kept in `enter(snap=True)`).

CRIU leaves a private file mapping's unwritten pages out of the image and maps the file
again at restore, so the image is smaller by the weights and a restore reads them from
the page cache without a copy. In exchange a restore needs each file at the same path,
of the same size, and whole (every byte fetched): the dumped replica fetches the rest of
each at its quiet point (`opener.complete_mapped_objects`), and a node whose cache lacks
one fetches it before the restore (`fetch_whole`, the objects named by the image's
`weights`); only when that fails does the replica boot cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ember_worker.weights.disk_cache import DiskCache
from ember_worker.weights.disk_object import DATA_SUFFIX, missing_bytes
from ember_worker.weights.origins import ObjectVersion

# Fetching weights the node lacks before a restore: past this, the replica boots cold
# (which would have to fetch them too, and then build everything on top).
FETCH_TIMEOUT = 600.0


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


def objects_to_fetch(
    mapped: Sequence[dict[str, Any]], weights: Sequence[dict[str, Any]], objects_dir: Path
) -> list[dict[str, Any]]:
    """The weights objects (url, s3_endpoint_url, tag, size) behind the files of `mapped`
    that the cache at `objects_dir` does not hold whole. A file's name is the cache key
    of its URL and version, so the image's `weights` (each object read, with its version
    tag) name them without asking any origin."""
    objects_dir = objects_dir.resolve()
    # A file mapped from another folder cannot be put where CRIU looks for it.
    by_name = {
        path.name: int(entry["size"])
        for entry in mapped
        if (path := Path(str(entry["path"]))).parent == objects_dir
    }
    wanted = []
    for read in weights:
        for name, size in by_name.items():
            key = DiskCache.key(str(read["url"]), ObjectVersion(size=size, tag=str(read["tag"])))
            if key + DATA_SUFFIX != name:
                continue
            if not (objects_dir / name).exists() or missing_bytes(objects_dir / name, size):
                wanted.append({**read, "size": size})
    return wanted


async def fetch_whole(
    objects: Sequence[dict[str, Any]], env: Mapping[str, str], timeout: float = FETCH_TIMEOUT
) -> list[dict[str, Any]]:
    """Fetch `objects` whole into the node's cache (`ember_worker.weights.fill`, in a
    process with the replica's environment `env`): its answer per object. Raises
    WeightsNotOnNode when the process fails or runs past `timeout`."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ember_worker.weights.fill",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
    )
    request = json.dumps({"objects": list(objects)}).encode()
    try:
        out, err = await asyncio.wait_for(process.communicate(request), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise WeightsNotOnNode(f"fetching its weights took over {timeout:g} s") from None
    if process.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise WeightsNotOnNode(f"fetching its weights failed: {last[0]}")
    answers: list[dict[str, Any]] = json.loads(out)["objects"]
    return answers
