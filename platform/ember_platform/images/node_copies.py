"""Nodes' copies of images (their roots, extracted or mounted): every node is told which
images the deployed endpoints run on when that changes for it (a node that joins, once
any image is deployed), and removes its copies of others once no replica of its own
uses them (the worker's images/root_collection.py). `ember image rm` tells them the
image is gone."""

from __future__ import annotations

from collections.abc import Iterable

from ember.wire import messages as wire
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.runtime.live_state import LiveState


def images_in_use(runtimes: Iterable[EndpointRuntime]) -> list[str]:
    """The digests of the images deployed endpoints (and canaries) run on."""
    return sorted({r.settings.image_digest for r in runtimes if r.settings.image_digest})


class NodeImageCopies:
    def __init__(self, state: LiveState) -> None:
        self.state = state
        self.told: dict[str, list[str]] = {}  # by worker id: what it was last told

    def sync(self) -> None:
        """Every node told which images deployments run on, where that changed for it
        (a node never told knows of no image, and keeps what it has)."""
        digests = images_in_use(self.state.runtimes())
        workers = list(self.state.workers.values())
        self.told = {w.id: self.told[w.id] for w in workers if w.id in self.told}
        for worker in workers:
            if self.told.get(worker.id, []) != digests:
                worker.send(wire.ImagesInUse(digests=digests))
                self.told[worker.id] = digests

    def forget(self, digest: str) -> None:
        """Every node frees its copies of a dropped image that no replica there uses."""
        for worker in list(self.state.workers.values()):
            worker.send(wire.ForgetImage(digest=digest))
