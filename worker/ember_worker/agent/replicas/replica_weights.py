"""The weights files an image maps, made whole in this node's cache before a replica is
restored from it (or ahead of that, beside an image fetched ahead): the image maps them
from the cache instead of carrying them, so a node that lacks them fetches them first."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.identity import WEIGHTS_CACHE_DIR_ENV
from ember_worker.processes.replica_users import ReplicaUser
from ember_worker.snapshots.criu_images import image_meta
from ember_worker.snapshots.errors import SnapshotError
from ember_worker.snapshots.mapped_weights import (
    WeightsNotOnNode,
    check_on_node,
    fetch_whole,
    objects_to_fetch,
)
from ember_worker.snapshots.snapshotter import Snapshotter
from ember_worker.weights.cache import workspace_caches
from ember_worker.weights.cache.disk_cache import objects_dir as cache_objects

log = logging.getLogger("ember.worker")

Note = Callable[[RunningReplica, str], None]
# A replica's environment, without GPUs, from its own variables (its start command's).
ReplicaEnv = Callable[[Mapping[str, str]], dict[str, str]]


class ImageWeights:
    """The weights files of the node's images, fetched whole where they are missing."""

    def __init__(self, snapshotter: Snapshotter, *, note: Note, replica_env: ReplicaEnv) -> None:
        self.snapshotter = snapshotter
        self.note = note  # a line into the replica's log
        self.replica_env = replica_env
        self._fetching_ahead = asyncio.Lock()  # each sees the room the last left

    def objects_for(self, user: ReplicaUser | None) -> Path | None:
        """The objects folder of the cache that `user`'s replicas read: its workspace's
        (the node's shared one for a worker that is not root); None without snapshots
        of weights."""
        shared = self.snapshotter.weights_objects
        if shared is None or user is None:
            return shared
        return cache_objects(workspace_caches.workspace_dir(shared.parent, user.uid))

    async def on_node(
        self,
        record: RunningReplica,
        command: wire.StartReplica,
        meta: dict[str, Any],
        objects_dir: Path,
    ) -> None:
        """Make sure the weights files the image maps are whole in this node's cache,
        fetching those it lacks first. WeightsNotOnNode if that cannot be done (the
        replica boots cold); SnapshotError if one changed at its origin since the
        snapshot (the image is stale)."""
        mapped = meta.get("mapped_weights") or []
        try:
            check_on_node(mapped, objects_dir)
            return
        except WeightsNotOnNode:
            wanted = objects_to_fetch(mapped, meta.get("weights") or [], objects_dir)
            if not wanted:
                raise
        began = time.monotonic()
        env = self.replica_env(command.env)
        env[WEIGHTS_CACHE_DIR_ENV] = str(objects_dir.parent)  # its workspace's cache
        answers = await fetch_whole(wanted, env, user=record.user)
        changed = [answer for answer in answers if "changed" in answer]
        if changed:
            raise SnapshotError(
                f"weights changed since the snapshot: {changed[0]['url']} is version "
                f"{changed[0]['changed']} now"
            )
        failed = [answer for answer in answers if "error" in answer]
        if failed:
            raise WeightsNotOnNode(f"fetching {failed[0]['url']} failed: {failed[0]['error']}")
        check_on_node(mapped, objects_dir)
        fetched = sum(int(answer.get("fetched_bytes") or 0) for answer in answers)
        self.note(
            record,
            f"fetched {fetched / 1e6:.1f} MB of weights that the snapshot maps into this "
            f"node's cache in {time.monotonic() - began:.2f} s",
        )

    async def fetch_ahead(
        self, command: wire.PrefetchSnapshot, room_for: Callable[[int], bool]
    ) -> str | None:
        """Beside an image fetched ahead (a `prefetch_snapshot` command): the weights files
        it maps that this node's cache lacks, fetched too if they fit beside what the cache
        holds (`room_for`, evicting nothing), so the first restore here waits for neither.
        A line for the endpoint's log, or None when nothing was fetched; a failure, or
        weights changed since the snapshot, costs only the head start (the restore finds
        out and fetches, or boots cold, then)."""
        snapshotter, objects_dir = self.snapshotter, self.snapshotter.weights_objects
        key, image_id = command.key, command.image_id
        if objects_dir is None or not snapshotter.has(key, image_id):
            return None
        async with self._fetching_ahead:
            try:
                meta = image_meta(await snapshotter.fetch(key, image_id))
            except SnapshotError:  # dropped meanwhile
                return None
            mapped = meta.get("mapped_weights") or []
            uid = workspace_caches.uid_of(str(mapped[0]["path"])) if mapped else None
            user = ReplicaUser(uid, uid) if uid is not None else None  # its gid: the same
            if user is not None:  # that workspace's cache (made if no replica made it yet)
                cache = await asyncio.to_thread(
                    workspace_caches.prepare_workspace, objects_dir.parent, user.uid, user.gid
                )
                objects_dir = cache_objects(cache)
            wanted = objects_to_fetch(mapped, meta.get("weights") or [], objects_dir)
            if not wanted:
                return None
            size = sum(int(entry["size"]) for entry in wanted)
            if not await asyncio.to_thread(room_for, size):
                return (
                    f"not fetching the {size / 1e6:.0f} MB of weights that snapshot {key[:12]} "
                    "maps ahead: the node's weights cache has no room for them without "
                    "evicting others (--weights-cache-gb)"
                )
            began = time.monotonic()
            try:
                env = self.replica_env(command.env or {})
                env[WEIGHTS_CACHE_DIR_ENV] = str(objects_dir.parent)
                answers = await fetch_whole(wanted, env, user=user)
            except WeightsNotOnNode as exc:
                log.warning("fetching snapshot %s's weights ahead failed: %s", key[:12], exc)
                return None
        fetched = sum(int(answer.get("fetched_bytes") or 0) for answer in answers)
        problems = [a for a in answers if "error" in a or "changed" in a]
        if problems or not fetched:
            for answer in problems:
                log.warning("fetching %s ahead: %s", answer["url"], answer)
            return None
        return (
            f"fetched ahead {fetched / 1e6:.1f} MB of weights that snapshot {key[:12]} maps, "
            f"in {time.monotonic() - began:.2f} s"
        )
