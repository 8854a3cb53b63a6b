"""The agent's side of image builds: a BuildImage command from the control plane run by
the node's builder in a thread, its output sent back in batches (ImageBuildOutput) and
its end (ImageBuildDone). The local files of copy steps come from the control plane
(uploaded there by the deploying client, one tar each), never from a path of the
client's machine."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import shutil
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ember.wire import messages as wire
from ember_worker.images.build_steps import StepLimits
from ember_worker.images.builder import ImageBuilder, ImageBuildError
from ember_worker.images.layer_store import LayerStore, LayerStoreError
from ember_worker.images.lazy.image_indexes import index_after_build

log = logging.getLogger("ember.worker")

FLUSH_SECONDS = 0.1
FILES_MEMBER = "file"  # a local_file step's one member in its tar (the name is not hashed)


def unpack_files(archive: Path, target: Path, kind: str) -> Path:
    """A copy step's tar unpacked into `target`: the folder (local_dir) or the file
    (local_file) its step copies. Extracted by root from a tenant's upload: tarfile's
    `data` filter refuses names, links and hard links that lead outside `target`, device
    nodes, and owners and set-uid bits; the builder checks the contents against the
    step's digest."""
    target.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target if kind == "local_dir" else target / FILES_MEMBER


class NodeImageBuilds:
    def __init__(
        self,
        store: LayerStore,
        folder: Path,
        send: Callable[[wire.FromAgent], Awaitable[None]],
        cache_bytes: int | None = None,
        limits: StepLimits | None = None,
    ) -> None:
        self.store = store
        self.limits = limits  # every step's timeout and cgroup
        self.folder = folder  # the builder's: its layer cache and scratch
        self.send = send
        self.cache_bytes = cache_bytes  # for the layers builds unpack (None: no limit)

    async def build(self, command: wire.BuildImage) -> None:
        loop = asyncio.get_running_loop()
        pending: list[str] = []
        done = asyncio.Event()

        def on_line(line: str) -> None:  # in the builder's thread
            loop.call_soon_threadsafe(pending.append, line)

        async def flush() -> None:
            while True:
                finished = done.is_set()
                if pending:
                    lines = pending[:]
                    pending.clear()
                    await self.send(wire.ImageBuildOutput(build_id=command.build_id, lines=lines))
                if finished:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), FLUSH_SECONDS)

        flushing = asyncio.ensure_future(flush())
        report = wire.ImageBuildDone(build_id=command.build_id)
        try:
            result = await asyncio.to_thread(self._build, command, on_line)
            report.built, report.reused = len(result.built), result.reused
            report.seconds = round(result.seconds, 2)
        except ImageBuildError as exc:
            report.error = str(exc)
        except (LayerStoreError, OSError, tarfile.TarError, ValueError) as exc:
            log.warning("image build %s failed: %s", command.build_id, exc)
            report.error = f"the build failed: {exc}"
        finally:
            await asyncio.sleep(0)  # the builder's last call_soon_threadsafe lines
            done.set()
            await flushing
        await self.send(report)

    def _build(self, command: wire.BuildImage, on_line: Callable[[str], None]) -> Any:
        """The build, in this thread: the copy steps' files fetched and unpacked first."""
        self.folder.mkdir(parents=True, exist_ok=True)
        image = copy.deepcopy(command.image)
        builder = ImageBuilder(self.store, self.folder, secrets=command.secrets, limits=self.limits)
        scratch = Path(tempfile.mkdtemp(prefix="files-", dir=builder.folder / "work"))
        try:
            for step in image.get("steps") or []:
                if step.get("kind") not in ("local_dir", "local_file"):
                    continue
                if builder.store.layer(str(step["digest"])) is not None:
                    continue  # built already: not needed
                sha256 = command.files.get(str(step.get("digest")))
                if sha256 is None:  # never a path of this node's: the client's files only
                    raise ValueError(f"the files of {step['kind']} {step['remote']} were not sent")
                archive = scratch / f"{sha256}.tar"
                self.store.fetch_files(sha256, archive)
                step["local"] = str(unpack_files(archive, scratch / sha256, step["kind"]))
                archive.unlink()
            result = builder.build(image, on_line, command.verify_registry)
            if result.built:  # lazy roots' file index, made once per image (images/lazy/)
                index_after_build(self.store, result.digest, self.folder / "indexes", on_line)
            return result
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            if self.cache_bytes is not None:
                try:
                    removed = builder.trim(self.cache_bytes)
                except OSError as error:  # the build's own outcome is what is reported
                    log.warning("unpacked image layers not trimmed: %s", error)
                else:
                    if removed:
                        log.info("removed %d unpacked image layer(s) past the budget", len(removed))
