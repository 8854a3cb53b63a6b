"""This node's process snapshots with CRIU (through pycriu, CRIU's RPC): take, publish,
fetch, restore. `Snapshotter` ties the parts together: the node's image cache
(`node_cache`), taking an image (`dump`), sharing and getting it through the control
plane's blob store (`image_transfer`), and restoring a replica from it (`restore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember_worker.processes.replica_processes import ReplicaPipes, ReplicaProcess
from ember_worker.processes.sandbox_mounts import SandboxPlan
from ember_worker.snapshots import cuda_checkpoint, side_files
from ember_worker.snapshots.criu_calls import (
    DUMP_TIMEOUT,
    DUMP_TIMEOUT_ENV,
    RESTORE_TIMEOUT,
    RESTORE_TIMEOUT_ENV,
    CriuCall,
    timeout_from_env,
)
from ember_worker.snapshots.dump import ImageTaker
from ember_worker.snapshots.image_transfer import ImageTransfer
from ember_worker.snapshots.node_cache import ImageCache
from ember_worker.snapshots.restore import ImageRestorer, LazyPagesDaemon, PagesIn
from ember_worker.snapshots.support import SnapshotSupport


class Snapshotter:
    """The node's snapshots: what the agent takes, publishes, fetches and restores."""

    def __init__(
        self,
        support: SnapshotSupport,
        root: Path,
        server_url: str,
        token: str,
        ca_cert: str | None,
        budget_bytes: int,
        same_on_every_node: Sequence[Path] = (),
        weights_objects: Path | None = None,
    ) -> None:
        self.support = support
        # The node's weights cache files (`mapped_weights`): a restore maps them again.
        self.weights_objects = weights_objects
        dump_timeout = timeout_from_env(DUMP_TIMEOUT_ENV, DUMP_TIMEOUT)
        restore_timeout = timeout_from_env(RESTORE_TIMEOUT_ENV, RESTORE_TIMEOUT)
        # CUDA checkpointing: None on machines without an NVIDIA GPU (no CUDA import).
        self.cuda, self.cuda_problem = cuda_checkpoint.detect()
        self.cache = ImageCache(root, budget_bytes)
        self.transfer = ImageTransfer(self.cache, server_url, token, ca_cert)
        self.taker = ImageTaker(
            support,
            self.cache,
            self.cuda,
            self.cuda_problem,
            # Files under these are not carried in images (`side_files`): every node has them.
            stable_roots=side_files.stable_roots(same_on_every_node),
            weights_objects=weights_objects,
            timeout=dump_timeout,
        )
        self.restorer = ImageRestorer(
            support, self.cache, self.cuda, self.cuda_problem, timeout=restore_timeout
        )

    @property
    def root(self) -> Path:
        return self.cache.root

    @property
    def in_use(self) -> dict[str, int]:
        """Readers of each image folder now (by name): never collected while read."""
        return self.cache.in_use

    async def dump(
        self,
        key: str,
        process: ReplicaProcess,
        gpus: Sequence[str] = (),
        weights: Sequence[dict[str, Any]] = (),
        sandbox: SandboxPlan | None = None,
        uid: int | None = None,
    ) -> dict[str, Any]:
        """Dump `process` (left running) into this node's cache (`ImageTaker.dump`)."""
        return await self.taker.dump(key, process, gpus, weights, sandbox, uid)

    async def publish(self, key: str, image_id: str) -> dict[str, Any]:
        """Upload this node's image for every other node (`ImageTransfer.publish`)."""
        return await self.transfer.publish(key, image_id)

    async def fetch(self, key: str, image_id: str | None) -> Path:
        """The image's folder on this node, downloaded once (`ImageTransfer.fetch`)."""
        return await self.transfer.fetch(key, image_id)

    async def fetch_ahead(self, key: str, image_id: str | None, size: int) -> float | None:
        """Fetch an image before a replica needs it (`ImageTransfer.fetch_ahead`)."""
        return await self.transfer.fetch_ahead(key, image_id, size)

    async def restore(
        self,
        images: Path,
        pipes: ReplicaPipes,
        lazy: bool = False,
        on_pages_in: PagesIn | None = None,
        gpu_pairs: Sequence[tuple[str, str]] = (),
        cgroup_procs: Sequence[Path] = (),
        sandbox: SandboxPlan | None = None,
        network: int | None = None,
    ) -> ReplicaProcess:
        """Restore a replica from `images` (`ImageRestorer.restore`)."""
        return await self.restorer.restore(
            images, pipes, lazy, on_pages_in, gpu_pairs, cgroup_procs, sandbox, network
        )

    @staticmethod
    def abort_all() -> None:
        """Kill CRIU calls in flight (the agent is stopping): their threads must end."""
        CriuCall.abort_all()
        LazyPagesDaemon.kill_all()

    def forget(self, key: str, image_id: str | None) -> None:
        """Drop a local image unless something reads it now (`ImageCache.forget`)."""
        self.cache.forget(key, image_id)

    def forget_key(self, key: str) -> list[str]:
        """Drop the local images of `key` that nothing reads now (`ImageCache.forget_key`)."""
        return self.cache.forget_key(key)

    def cached(self) -> list[tuple[str, str]]:
        """(key, image id) of each complete image in this node's cache."""
        return self.cache.cached()

    def has(self, key: str, image_id: str | None) -> bool:
        """Whether the image is in this node's cache."""
        return self.cache.has(key, image_id)

    def room_for(self, size: int) -> bool:
        """Whether an image of `size` bytes fits beside what the cache holds."""
        return self.cache.room_for(size)

    def collect_garbage(self) -> list[str]:
        """Remove the least recently used images until the cache fits its budget."""
        return self.cache.collect_garbage()
