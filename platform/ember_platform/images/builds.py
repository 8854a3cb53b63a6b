"""Image builds, run on worker nodes (never here): one build per image at a time in the
cluster, whoever asks for it. A build goes to a node that takes replicas, the one with
the fewest builds under way (then the most CPUs); its output comes back over the node's
channel (ImageBuildOutput, ImageBuildDone) and is kept for every follower, who reads it
from the start. A node that leaves during a build fails it. A build that ends has its
uploaded local files deleted (blob_garbage.py)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ember.wire import messages as wire
from ember_platform.images.blob_garbage import ImageBlobGarbage
from ember_platform.runtime.cluster_model import Worker
from ember_platform.runtime.live_state import LiveState

MAX_LINES = 20_000  # kept per build for followers; a build's own output beyond is dropped
WORKER_CHECK_SECONDS = 2.0


@dataclass
class Build:
    id: str
    digest: str  # the image's, or "<workspace> <digest>" for one only it follows
    worker_id: str
    worker_name: str
    layers: list[str] = field(default_factory=list)  # its image's layer digests
    files: list[str] = field(default_factory=list)  # sha256s of its uploaded files
    started_at: float = field(default_factory=time.time)
    lines: list[str] = field(default_factory=list)
    dropped: int = 0
    finished: bool = False
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, lines: list[str]) -> None:
        room = MAX_LINES - len(self.lines)
        self.lines.extend(lines[: max(room, 0)])
        self.dropped += max(len(lines) - max(room, 0), 0)
        self._wake()

    def finish(self, error: str | None, summary: dict[str, Any] | None = None) -> None:
        if self.finished:
            return
        self.finished, self.error, self.summary = True, error, summary or {}
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class ImageBuilds:
    def __init__(self, state: LiveState, garbage: ImageBlobGarbage | None = None) -> None:
        self.state = state
        self.garbage = garbage  # deletes a finished build's uploaded files
        self.running: dict[str, Build] = {}  # by image digest
        self.by_id: dict[str, Build] = {}

    def start(
        self,
        image: dict[str, Any],
        files: dict[str, str],
        values: dict[str, dict[str, str]],
        workspace: str | None = None,
        verify_registry: bool = True,
    ) -> Build:
        """The build of `image` under way, or a new one on a node (ValueError when no
        node takes work). A build with `workspace` (an image pulled from a registry,
        with that workspace's secrets) is followed by that workspace's requests only:
        another's must reach the registry with its own credentials. With
        `verify_registry`, the node has the registry accept the credentials for a
        pulled layer it reuses."""
        digest = str(image["digest"])
        key = digest if workspace is None else f"{workspace} {digest}"
        running = self.running.get(key)
        if running is not None and not running.finished:
            return running
        worker = self._pick()
        build = Build("b-" + secrets.token_hex(6), key, worker.id, worker.name)
        build.layers = [str(step.get("digest")) for step in image.get("steps") or []]
        build.files = sorted(set(files.values()))
        self.running[key] = build
        self.by_id[build.id] = build
        worker.send(
            wire.BuildImage(
                build_id=build.id,
                image=image,
                files=files,
                secrets=values,
                verify_registry=verify_registry,
            )
        )
        return build

    def _pick(self) -> Worker:
        workers = [w for w in self.state.workers.values() if not self.state.takes_no_replicas(w)]
        if not workers:
            raise ValueError("no worker node is connected to build the image on")
        load = {w.id: 0 for w in workers}
        for build in self.running.values():
            if not build.finished and build.worker_id in load:
                load[build.worker_id] += 1
        return min(workers, key=lambda w: (load[w.id], -w.cpu, w.name))

    def message(self, worker: Worker, message: wire.ImageBuildOutput | wire.ImageBuildDone) -> None:
        """A node's report of a build it runs (others' are ignored)."""
        build = self.by_id.get(message.build_id)
        if build is None or build.worker_id != worker.id:
            return
        if isinstance(message, wire.ImageBuildOutput):
            build.add(message.lines)
            return
        build.finish(
            message.error,
            {"built": message.built, "reused": message.reused, "seconds": message.seconds},
        )
        self._forget(build)

    def building(self) -> tuple[set[str], set[str]]:
        """The layer digests and uploaded files' sha256s of the builds under way."""
        builds = [b for b in self.running.values() if not b.finished]
        return {d for b in builds for d in b.layers}, {f for b in builds for f in b.files}

    def _forget(self, build: Build) -> None:
        self.by_id.pop(build.id, None)
        if self.running.get(build.digest) is build:
            del self.running[build.digest]
        if self.garbage is not None and build.files:
            _, in_use = self.building()
            self.garbage.files_after_build(
                [f for f in build.files if f not in in_use], build.started_at
            )

    async def follow(self, build: Build) -> AsyncIterator[str]:
        """Every line of the build from its first, as they come, until it ends."""
        seen = 0
        while True:
            changed = build.changed
            while seen < len(build.lines):
                yield build.lines[seen]
                seen += 1
            if build.finished:
                return
            try:
                await asyncio.wait_for(changed.wait(), WORKER_CHECK_SECONDS)
            except TimeoutError:
                if build.worker_id not in self.state.workers:
                    build.finish(
                        f"worker {build.worker_name} left during the build; deploy again "
                        "to build on another node"
                    )
                    self._forget(build)
