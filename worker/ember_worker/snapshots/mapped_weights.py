"""Weights a snapshot maps instead of holding: files of the node's weights cache that the
dumped replica still had mapped (tensors from `state_dict()`, kept in `enter(snap=True)`).

CRIU leaves a private file mapping's unwritten pages out of the image and maps the file
again at restore, so the image is smaller by the weights and a restore reads them from
the page cache without a copy. In exchange a restore needs each file at the same path,
of the same size, and whole (every byte fetched): the dumped replica fetches the rest of
each at its quiet point (`opener.complete_mapped_objects`), and a node whose cache lacks
one fetches it before the restore (`fetch_whole`, the objects named by the image's
`weights`); only when that fails does the replica boot cold. A node whose cache is in
another folder holds the file under the same name and links it at the image's path for
the restore (`linked_in_place`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ember_worker.processes.process_env import ROOT_ENV
from ember_worker.processes.replica_users import ReplicaUser
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.cache.disk_object import DATA_SUFFIX, missing_bytes
from ember_worker.weights.cache.workspace_caches import PREFIX as WORKSPACE_PREFIX
from ember_worker.weights.origins.origin import ObjectVersion

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
        # The node's shared cache, or a workspace's beside it (workspace_caches.py).
        in_cache = path.parent == objects_dir or (
            path.parent.name == objects_dir.name
            and path.parent.parent.parent == objects_dir.parent
            and path.parent.parent.name.startswith(WORKSPACE_PREFIX)
        )
        if not in_cache or path.suffix != DATA_SUFFIX:
            continue
        try:
            size = os.stat(path).st_size
        except OSError:  # evicted meanwhile: CRIU will say so if it matters
            continue
        found.append({"path": text, "size": size})
    return found


def check_on_node(mapped: Sequence[dict[str, Any]], objects_dir: Path) -> None:
    """Raise WeightsNotOnNode unless every file of `mapped` (`find`'s entries) is in the
    cache at `objects_dir` with its size and every byte. A file the image maps from
    another folder (a node whose work dir is elsewhere) is looked for here by its name,
    the cache key of its object: `linked_in_place` then puts it where CRIU looks."""
    objects_dir = objects_dir.resolve()
    for entry in mapped:
        path, size = objects_dir / Path(str(entry["path"])).name, int(entry["size"])
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


def _whole_copy(path: Path, size: int) -> bool:
    """Whether `path` is a cache's data file of `size` bytes, every one fetched (another
    worker's cache on this machine, at the path the image names)."""
    return (
        path.is_file()
        and not path.is_symlink()
        and path.stat().st_size == size
        and missing_bytes(path, size) == 0
    )


@contextlib.contextmanager
def linked_in_place(mapped: Sequence[dict[str, Any]], objects_dir: Path) -> Iterator[None]:
    """While the restore runs: each file the image maps from another folder than this
    node's cache is there as a symbolic link to this cache's copy (CRIU opens a mapped
    file by the path it had), removed again once the restore has mapped it. A path
    that some other file holds declines the restore (WeightsNotOnNode)."""
    objects_dir = objects_dir.resolve()
    made: list[Path] = []
    folders: list[Path] = []  # made for the links: removed after them, if left empty
    try:
        for entry in mapped:
            path = Path(str(entry["path"]))
            ours = objects_dir / path.name
            if path.parent == objects_dir:
                continue
            if os.path.lexists(path):
                try:
                    same = os.path.samefile(path, ours)
                except OSError:  # a dangling link, say
                    same = False
                if same or _whole_copy(path, int(entry["size"])):
                    continue  # the same object (its name is its cache key), whole
                if not path.is_symlink():
                    raise WeightsNotOnNode(f"it maps {path}, which another file holds here")
                path.unlink()  # a link (left by a restore cut off, say): only a name goes
            try:
                folders += _missing_folders(path.parent)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.symlink_to(ours)
            except OSError as exc:
                raise WeightsNotOnNode(f"cannot put {path.name} at {path}: {exc}") from None
            made.append(path)
        yield
    finally:
        for link in made:
            with contextlib.suppress(OSError):
                link.unlink()
        for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


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
    # By name: one mapped from another folder is fetched here and linked there.
    by_name = {Path(str(entry["path"])).name: int(entry["size"]) for entry in mapped}
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
    objects: Sequence[dict[str, Any]],
    env: Mapping[str, str],
    timeout: float = FETCH_TIMEOUT,
    user: ReplicaUser | None = None,
) -> list[dict[str, Any]]:
    """Fetch `objects` whole into the node's cache (`ember_worker.weights.fill`, in a
    process with the replica's environment `env`, as `user`, whose workspace's cache it
    fills: root never writes in a folder a tenant controls): its answer per object.
    Raises WeightsNotOnNode when the process fails or runs past `timeout`."""
    as_user: dict[str, Any] = {}
    if user is not None:
        as_user = {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": "/"}
    # Isolated (-I) and with the agent's fixed environment: the replica's variables (its
    # tenant's PYTHONPATH, LD_PRELOAD) go in the request, as data for its clients.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-m",
        "ember_worker.weights.fill",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ROOT_ENV,
        **as_user,
    )
    request = json.dumps({"objects": list(objects), "env": dict(env)}).encode()
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
