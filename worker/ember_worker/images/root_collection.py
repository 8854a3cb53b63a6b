"""Collection of a node's image roots (extracted trees and lazy mounts, image_roots.py).

The control plane tells every node which images its deployed endpoints run on
(`ImagesInUse`, after each change and now and then) and which image was dropped
(`ForgetImage`, from `ember image rm`). A root goes when no replica here uses it (one
starting, running or being restored: the agent's records say, asked while the image's
lock is held, which a start holds while it makes the root) and either no deployment
runs on its image or it is the least recently used past the disk budget
(`--image-roots-gb`; a lazy mount costs the disk nothing here: its chunks are in the
image cache, which has its own budget). Until the node is first told, nothing is
removed for being unwanted: it does not know yet.

`roots_to_remove` is the policy, pure; `ImageRootCollector` runs it on the agent's loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from ember_worker.images.image_roots import ImageRoots, NodeRoot

log = logging.getLogger("ember.worker.images")


def roots_to_remove(
    roots: Sequence[NodeRoot],
    *,
    in_use: AbstractSet[str],
    wanted: AbstractSet[str] | None,
    dropped: AbstractSet[str] = frozenset(),
    budget_bytes: int,
) -> list[str]:
    """The images whose roots go, in order: those `dropped` or not `wanted` (None: not
    known yet), then the least recently used past `budget_bytes` of disk. Never one
    `in_use`."""
    free = [root for root in roots if root.digest not in in_use]
    removed: list[str] = []
    for root in free:
        unwanted = wanted is not None and root.digest not in wanted
        if (root.digest in dropped or unwanted) and root.digest not in removed:
            removed.append(root.digest)
    total = sum(root.size for root in roots if root.digest not in removed)
    for root in sorted(free, key=lambda r: (r.used_at, r.digest)):
        if total <= budget_bytes:
            break
        if root.size == 0 or root.digest in removed:
            continue
        removed.append(root.digest)
        total -= sum(r.size for r in roots if r.digest == root.digest)
    return removed


class ImageRootCollector:
    def __init__(
        self,
        roots: ImageRoots,
        budget_bytes: int,
        in_use: Callable[[], set[str]],
    ) -> None:
        self.roots = roots
        self.budget_bytes = budget_bytes
        self.in_use = in_use  # images of the replicas starting or running here
        self.wanted: set[str] | None = None  # the cluster's, once told
        self.dropped: set[str] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[list[str]]] = set()

    def told(self, digests: list[str]) -> None:
        """The images the cluster's deployments run on (ImagesInUse): one deployed again
        after `ember image rm` (built again) is kept again."""
        self.wanted = set(digests)
        self.dropped -= self.wanted
        self.collect_soon()

    def forget(self, digest: str) -> None:
        """An image dropped from the cluster (ForgetImage): its copies go once unused."""
        self.dropped.add(digest)
        if self.wanted is not None:
            self.wanted.discard(digest)
        self.collect_soon()

    async def collect(self) -> list[str]:
        """Remove what the policy says; the digests whose roots went."""
        async with self._lock:
            try:
                present = await asyncio.to_thread(self.roots.present)
            except OSError as error:
                log.warning("image roots not collected: %s", error)
                return []
            chosen = roots_to_remove(
                present,
                in_use=self.in_use(),
                wanted=self.wanted,
                dropped=self.dropped,
                budget_bytes=self.budget_bytes,
            )
            removed = []
            for digest in chosen:
                async with self.roots.lock_for(digest):
                    # Asked again under the lock: a start may have begun meanwhile.
                    if digest in self.in_use():
                        continue
                    try:
                        await asyncio.to_thread(self.roots.remove, digest)
                    except OSError as error:
                        log.warning("image %s: its root not removed: %s", digest[7:19], error)
                        continue
                removed.append(digest)
            # Kept only while a replica here still uses its root.
            self.dropped &= {root.digest for root in present} - set(removed)
            if removed:
                log.info(
                    "removed this node's roots of %d image(s) no replica here uses: %s",
                    len(removed),
                    ", ".join(d[7:19] for d in removed),
                )
            return removed

    def collect_soon(self) -> None:
        """collect() in the background (told something, or a replica ended)."""
        task = asyncio.ensure_future(self.collect())
        self._tasks.add(task)  # kept until done
        task.add_done_callback(self._tasks.discard)
