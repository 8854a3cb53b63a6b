"""Taking an image: a replica blocked at its quiet point (after `enter(snap=True)`, before
any connection) dumped by CRIU and left running. Its five pipes are external to the image
(meta.json names them); the files it uses that other nodes lack go in beside it
(`side_files`), the weights files it maps stay in the node's cache (`mapped_weights`).
On a GPU node the CUDA driver moves its device memory into host memory before the dump
and back after it (`cuda_checkpoint`)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember_worker.processes.replica_processes import ReplicaPipes, ReplicaProcess, pipe_key
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME, SandboxPlan
from ember_worker.snapshots import cuda_checkpoint, mapped_weights, side_files
from ember_worker.snapshots.criu_calls import LOG_LEVEL, CriuCall, criu_error_lines
from ember_worker.snapshots.criu_images import NETWORK_KEY, PIPE_ROLES
from ember_worker.snapshots.cuda_checkpoint import CudaCheckpointer
from ember_worker.snapshots.errors import SnapshotError, gpu_step
from ember_worker.snapshots.node_cache import ImageCache
from ember_worker.snapshots.support import SnapshotSupport

# Paths inside a sandbox that are its own, not the node's: its working area, /tmp and
# /dev/shm (its scratch tmpfs) travel as side files, read through /proc/<pid>/root.
SANDBOX_OWN = (SANDBOX_HOME + "/", "/tmp/", "/dev/shm/")


def _agent_end(pipes: ReplicaPipes, role: str) -> int:
    return getattr(pipes, role)


class ImageTaker:
    """Dumps replicas into images in the node's cache."""

    def __init__(
        self,
        support: SnapshotSupport,
        cache: ImageCache,
        cuda: CudaCheckpointer | None,
        cuda_problem: str | None,
        *,
        stable_roots: Sequence[Path],
        weights_objects: Path | None,
        timeout: float,
    ) -> None:
        self.support = support
        self.cache = cache
        self.cuda = cuda  # None on machines without an NVIDIA GPU
        self.cuda_problem = cuda_problem
        self.stable_roots = stable_roots  # files under these are not carried in images
        self.weights_objects = weights_objects  # the node's weights cache files
        self.timeout = timeout

    async def dump(
        self,
        key: str,
        process: ReplicaProcess,
        gpus: Sequence[str] = (),
        weights: Sequence[dict[str, Any]] = (),
        sandbox: SandboxPlan | None = None,
        uid: int | None = None,
    ) -> dict[str, Any]:
        """Dump `process` (left running) into this node's cache; returns its metadata.
        `sandbox`: the plan of its mount namespace, whose bind mounts are external to
        the image (a restore mounts its own replica's); `uid`: its workspace's here
        (a restore elsewhere runs as it, or boots cold).
        Replicas on this node can restore from it at once; `publish` shares it. `gpus`:
        the visible ids of the GPUs the process holds (a restore elsewhere maps them);
        `weights`: the weights objects it read, with their versions (a restored replica
        checks them before it serves)."""
        if self.support.criu_binary is None:
            raise SnapshotError("CRIU is not available")
        work = self.cache.work_dir(f".take-{key[:12]}-")
        images = work / "images"
        images.mkdir()
        started = time.monotonic()
        image_id = secrets.token_hex(6)
        try:
            meta: dict[str, Any] = {
                "key": key,
                "image_id": image_id,
                "pipes": {role: pipe_key(_agent_end(process.pipes, role)) for role in PIPE_ROLES},
                "created_at": time.time(),
                "gpus": list(gpus),
                "weights": list(weights),
                "sandbox": sandbox is not None,
                "uid": uid,
            }
            gpu = await gpu_step(
                cuda_checkpoint.needs_checkpoint, self.cuda, self.cuda_problem, process.pid
            )
            used = await asyncio.to_thread(side_files.files_of_tree, process.pid)
            names: dict[Path, str] = {}
            if sandbox is not None:
                # Its own files, read where the node finds them; the rest by their names
                # on the node (its device nodes are the node's).
                inside = f"/proc/{process.pid}/root"
                names = {Path(inside + p): p for p in used if p.startswith(SANDBOX_OWN)}
                used = {
                    sandbox.on_node(p) for p in used if not p.startswith((*SANDBOX_OWN, "/dev/"))
                }
            carried = side_files.to_carry(used, self.stable_roots)
            carried += side_files.to_carry(map(str, names), ())
            if self.weights_objects is not None:
                meta["mapped_weights"] = mapped_weights.find(used, self.weights_objects)
            call = CriuCall(self.support.criu_binary)
            images_fd = os.open(images, os.O_DIRECTORY)
            try:
                if gpu and self.cuda is not None:  # lock, device memory to host memory
                    meta["cuda_seconds"] = await gpu_step(self.cuda.checkpoint, process.pid)
                opts = call.criu.opts
                opts.images_dir_fd = images_fd
                opts.log_file = "dump.log"
                opts.log_level = LOG_LEVEL
                opts.pid = process.pid
                opts.leave_running = True
                opts.shell_job = False
                network = own_network(process.pid)
                if network is not None:
                    # Its network namespace is not in the image: a restore gets a new one
                    # (networks/namespaces.py), and its sockets are restored into it.
                    opts.external.append(f"net[{network}]:{NETWORK_KEY}")
                    # Its TCP sockets are dumped too: listeners (an engine's sidecar, its
                    # metrics), and connections, kept open: those on its own loopback
                    # carry on after a restore; one to the outside is reset by its peer
                    # at its next use (pasta of the restore knows nothing of it), as a
                    # pool's idle connection would be. No packet filter lock: the
                    # namespace is the replica's alone, quiet while it is dumped, and
                    # what a peer sends meanwhile is sent again.
                    opts.tcp_established = True
                    opts.network_lock = call.pycriu.rpc.SKIP
                meta["network"] = network is not None
                for mount in sandbox.mounts if sandbox is not None else ():
                    entry = opts.ext_mnt.add()
                    entry.key, entry.val = mount.target, mount.key
                await call.run("dump", self.timeout)
            except (call.pycriu.CRIUException, SnapshotError) as exc:
                # A timeout too: what CRIU logged says where it hung.
                lines = criu_error_lines(images / "dump.log")
                held = isinstance(exc, SnapshotError) and exc.held_killed
                raise SnapshotError(f"{exc}: {lines}", held_killed=held) from None
            finally:
                os.close(images_fd)
                if gpu:  # after a dump or a failure alike: restore and unlock
                    await self._gpu_resume(process)
            (images / "dump.log").unlink(missing_ok=True)
            packed = await asyncio.to_thread(
                side_files.pack, carried, images, side_files.MAX_BYTES, names
            )
            meta["side_files"] = {"files": packed.files, "bytes": packed.bytes}
            if packed.skipped:
                # Restores on this node still work; elsewhere they fall back to cold boots.
                meta["side_files"]["skipped"] = packed.skipped[:20]
            meta["cuda"] = gpu
            meta["dump_seconds"] = time.monotonic() - started
            meta["raw_size"] = sum(p.stat().st_size for p in images.iterdir())
            # meta.json last: its presence marks a complete image in the cache.
            (images / "meta.json").write_text(json.dumps(meta))
            target = self.cache.folder(key, image_id)
            os.replace(work, target)
            # The new image stays, whatever its size.
            self.cache.hold(target.name)
            try:
                await asyncio.to_thread(self.cache.collect_garbage)
            finally:
                self.cache.release(target.name)
            return meta
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _gpu_resume(self, process: ReplicaProcess) -> None:
        """Give the dumped original its GPU state back; if that fails it cannot use the
        GPU again, so it is killed (and replaced by a cold boot)."""
        if self.cuda is None:
            return
        try:
            await gpu_step(self.cuda.resume, process.pid)
        except SnapshotError as exc:
            process.kill()
            raise SnapshotError(f"{exc}; the replica was stopped") from None


def own_network(pid: int) -> int | None:
    """The inode of `pid`'s network namespace where it is not ours (the node's): None
    where it shares the node's."""
    theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
    return theirs if theirs != os.stat("/proc/self/ns/net").st_ino else None
