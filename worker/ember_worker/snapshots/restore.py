"""Restoring a replica from an image: its pipes handed in for the image's (`inherit_fd`),
so the restored process talks to this agent and reads its new identity from the control
pipe; its GPU state copied back to the device (perhaps onto other GPUs of the chip).

A lazy restore runs the process as soon as its non-memory state is back: CRIU's
lazy-pages daemon gives it each page on first touch and copies the rest in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

from ember_worker.processes.replica_processes import ReplicaPipes, ReplicaProcess, adopt_restored
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME, SandboxPlan
from ember_worker.snapshots import side_files
from ember_worker.snapshots.criu_calls import LOG_LEVEL, CriuCall, criu_error_lines
from ember_worker.snapshots.criu_images import NETWORK_KEY, PIPE_ROLES, check_pages, image_meta
from ember_worker.snapshots.cuda_checkpoint import CudaCheckpointer
from ember_worker.snapshots.errors import SnapshotError, gpu_step
from ember_worker.snapshots.node_cache import ImageCache
from ember_worker.snapshots.support import SnapshotSupport, restores_lazily

LAZY_SOCKET = "lazy-pages.socket"  # CRIU's name, in the restore's work dir
LAZY_DAEMON_START_TIMEOUT = 5.0
LAZY_PAGES_TIMEOUT = 300.0  # a restored process not fully in by then is killed

PagesIn = Callable[[float, str | None], None]


def _child_end(pipes: ReplicaPipes, role: str) -> int:
    return {
        "lifeline": pipes.child_stdin,
        "stdout": pipes.child_stdout,
        "stderr": pipes.child_stderr,
        "control": pipes.child_control,
        "status": pipes.child_status,
    }[role]


class LazyPagesDaemon:
    """`criu lazy-pages` for one restore: it listens in the restore's work dir, serves
    the restored process's page faults from the image, pushes the remaining pages in the
    background, and exits once every page is in (or the process has gone)."""

    active: ClassVar[set[LazyPagesDaemon]] = set()  # running daemons, for kill_all()

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log
        self.started = time.monotonic()

    @classmethod
    async def start(cls, binary: str, images: Path, work: Path) -> LazyPagesDaemon:
        log = work / "lazy-pages.log"
        process = await asyncio.create_subprocess_exec(
            binary,
            "lazy-pages",
            "--images-dir",
            str(images),
            "--work-dir",
            str(work),
            "--log-file",
            log.name,
            f"-v{LOG_LEVEL}",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        daemon = cls(process, log)
        cls.active.add(daemon)
        deadline = time.monotonic() + LAZY_DAEMON_START_TIMEOUT
        while not (work / LAZY_SOCKET).exists():
            if process.returncode is not None or time.monotonic() > deadline:
                daemon.kill()
                await daemon.wait()
                raise SnapshotError(
                    f"CRIU's lazy-pages daemon did not start: {criu_error_lines(log)}"
                )
            await asyncio.sleep(0.002)
        return daemon

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code; None (and killed) if it runs past `timeout`."""
        try:
            return await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            self.kill()
            await self.process.wait()
            return None
        finally:
            if self.process.returncode is not None:
                self.active.discard(self)

    @classmethod
    def kill_all(cls) -> None:
        for daemon in list(cls.active):
            daemon.kill()


class ImageRestorer:
    """Restores replicas from images in the node's cache."""

    def __init__(
        self,
        support: SnapshotSupport,
        cache: ImageCache,
        cuda: CudaCheckpointer | None,
        cuda_problem: str | None,
        *,
        timeout: float,
    ) -> None:
        self.support = support
        self.cache = cache
        self.cuda = cuda  # None on machines without an NVIDIA GPU
        self.cuda_problem = cuda_problem
        self.timeout = timeout
        self._lazy_watchers: set[asyncio.Task[None]] = set()

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
        """Restore a replica from `images`, its pipes handed in for the image's (and its
        network namespace: `network`, open, where the image was taken in one), into
        the cgroups of `cgroup_procs` (else the agent's), into the mount namespace of
        `sandbox` (its root folder, its bind mounts: this replica's own). An image
        taken outside a sandbox is not restored into one, nor the other way round.

        Lazy (`restores_lazily`): the process runs as soon as its non-memory
        state is back; CRIU's lazy-pages daemon gives it each page on first touch and
        copies the rest in the background. `on_pages_in(seconds, error)` is called when
        all of its memory is in (or never will be: then the process has been killed).
        `gpu_pairs` (old UUID, new UUID) move the image's GPU state onto other GPUs."""
        if self.support.criu_binary is None:
            raise SnapshotError("CRIU is not available")
        meta = image_meta(images)
        if meta.get("cuda") and self.cuda is None:
            why = self.cuda_problem or "this node has no NVIDIA GPU"
            raise SnapshotError(f"the image holds GPU state this node cannot restore: {why}")
        if bool(meta.get("sandbox")) != (sandbox is not None):
            taken = "inside" if meta.get("sandbox") else "outside"
            raise SnapshotError(f"the image was taken {taken} a sandbox, this replica is not")
        if bool(meta.get("network")) != (network is not None):
            taken = "in a network of its own" if meta.get("network") else "in the node's network"
            raise SnapshotError(f"the image was taken {taken}, this replica is not")
        lazy = restores_lazily(lazy, self.support, meta)
        await asyncio.to_thread(check_pages, images)
        try:
            # Files of its working area, /tmp and /dev/shm go into this replica's own.
            own = [
                (mount.target, Path(mount.source))
                for mount in (sandbox.mounts if sandbox is not None else ())
                if mount.target in (SANDBOX_HOME, "/tmp", "/dev/shm")
            ]
            await asyncio.to_thread(side_files.put_back, images, own)
        except (OSError, tarfile.TarError) as exc:
            raise SnapshotError(f"the files the image needs could not be put back: {exc}") from None
        work = self.cache.work_dir(".restore-")
        name = images.parent.name  # its folder in the cache: not collected while read
        self.cache.hold(name)
        daemon: LazyPagesDaemon | None = None
        try:
            if lazy:
                daemon = await LazyPagesDaemon.start(self.support.criu_binary, images, work)
            call = CriuCall(self.support.criu_binary, cgroup_procs)
            images_fd = os.open(images, os.O_DIRECTORY)
            work_fd = os.open(work, os.O_DIRECTORY)
            try:
                opts = call.criu.opts
                opts.images_dir_fd = images_fd
                opts.work_dir_fd = work_fd
                opts.log_file = "restore.log"
                opts.log_level = LOG_LEVEL
                opts.rst_sibling = True  # the restored replica is our child: we reap it
                opts.shell_job = False
                opts.lazy_pages = lazy
                # The replica stays in the cgroups CRIU runs in (processes/cgroups.py), not
                # those of the process the image was taken from: another replica's.
                opts.manage_cgroups_mode = call.pycriu.rpc.IGNORE
                if sandbox is not None:  # its root folder, and its own mounts in it
                    opts.root = sandbox.root
                    for mount in sandbox.mounts:
                        entry = opts.ext_mnt.add()
                        entry.key, entry.val = mount.key, mount.source
                if network is not None:
                    os.set_inheritable(network, True)
                    entry = opts.inherit_fd.add()
                    entry.key, entry.fd = NETWORK_KEY, network
                    # Its TCP sockets come back as they were (dump.py), into a fresh
                    # namespace nothing else uses yet: no packet filter lock to lift.
                    opts.tcp_established = True
                    opts.network_lock = call.pycriu.rpc.SKIP
                for role in PIPE_ROLES:
                    fd = _child_end(pipes, role)
                    os.set_inheritable(fd, True)  # CRIU's swrk process must get it
                    entry = opts.inherit_fd.add()
                    entry.key = meta["pipes"][role]
                    entry.fd = fd
                response = await call.run("restore", self.timeout)
            except (call.pycriu.CRIUException, SnapshotError) as exc:
                lines = criu_error_lines(work / "restore.log")
                if daemon is not None:
                    lines += " | lazy pages: " + criu_error_lines(daemon.log)
                raise SnapshotError(f"{exc}: {lines}") from None
            finally:
                os.close(images_fd)
                os.close(work_fd)
            process = adopt_restored(int(response.pid), pipes)
            if meta.get("cuda") and self.cuda is not None:
                try:  # host memory back to the device, then unlock
                    began = time.monotonic()
                    await gpu_step(self.cuda.restore, process.pid, gpu_pairs)
                    process.gpu_restore_seconds = time.monotonic() - began
                except SnapshotError:
                    process.kill()
                    await process.wait()  # reaped here: the agent never adopts it
                    raise
        except BaseException:
            if daemon is not None:
                daemon.kill()
                await daemon.wait()
            self.cache.release(name)
            shutil.rmtree(work, ignore_errors=True)
            raise
        if daemon is None:
            self.cache.release(name)
            shutil.rmtree(work, ignore_errors=True)
        else:
            # The image and the work dir stay until the daemon has handed every page over.
            task = asyncio.ensure_future(
                self._watch_lazy_pages(daemon, process, name, work, on_pages_in)
            )
            self._lazy_watchers.add(task)
            task.add_done_callback(self._lazy_watchers.discard)
        return process

    async def _watch_lazy_pages(
        self,
        daemon: LazyPagesDaemon,
        process: ReplicaProcess,
        name: str,
        work: Path,
        on_pages_in: PagesIn | None,
    ) -> None:
        error: str | None = None
        try:
            returncode = await daemon.wait(LAZY_PAGES_TIMEOUT)
            if returncode is None:
                error = f"not all pages were in after {LAZY_PAGES_TIMEOUT:g} s"
            elif returncode != 0:
                # It exits 0 when its replica ends first: anything else is its own failure.
                error = f"exit code {returncode}: {criu_error_lines(daemon.log)}"
            if error is not None:
                process.kill()  # it would wait forever on a page that never comes
        finally:
            self.cache.release(name)
            shutil.rmtree(work, ignore_errors=True)
        if on_pages_in is not None and (error is not None or process.returncode is None):
            on_pages_in(time.monotonic() - daemon.started, error)
