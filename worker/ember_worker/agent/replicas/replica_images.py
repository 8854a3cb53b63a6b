"""The agent's side of its replicas' snapshots: a replica restored from an image (the
GPUs it was taken on, a huge-page view, the check of its weights), a cold replica dumped
at its quiet point and let run on while its image is published, an image a replica could
not be restored from dropped, and the retake of a new one after that."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ember.wire import messages as wire
from ember_worker.agent.replicas.gang_members import gang_env
from ember_worker.agent.replicas.replica_weights import ImageWeights, Note, ReplicaEnv
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.gpu_slots import GpuMoveError, restore_moves, visible_devices
from ember_worker.identity import ReplicaIdentity
from ember_worker.processes.replica_processes import ReplicaPipes, ReplicaProcess, open_reader
from ember_worker.resources import GpuDevice
from ember_worker.snapshots.criu_images import image_meta
from ember_worker.snapshots.errors import SnapshotError
from ember_worker.snapshots.huge_pages import huge_page_images
from ember_worker.snapshots.mapped_weights import WeightsNotOnNode, linked_in_place, total_bytes
from ember_worker.snapshots.snapshotter import Snapshotter
from ember_worker.snapshots.support import restores_lazily

log = logging.getLogger("ember.worker")

# A restored replica checks the versions of the weights it read before the snapshot in
# at most 20 s (replica.py); it is let run on if it has not said by then.
WEIGHTS_VERDICT_TIMEOUT = 30.0
# How long a replica booting cold after a failed restore waits at its quiet point for
# the control plane to say whether it takes the new snapshot (asked before it booted).
RETAKE_ANSWER_TIMEOUT = 10.0

Send = Callable[[wire.FromAgent], Coroutine[Any, Any, None]]
Spawn = Callable[[Coroutine[Any, Any, None]], None]
TakeGpus = Callable[[RunningReplica, wire.StartReplica, Sequence[str]], list[GpuDevice]]


class UidMoveError(Exception):
    """The image was taken as another uid than the one this node gives its workspace."""


class ReplicaSnapshots:
    def __init__(
        self,
        snapshotter: Snapshotter,
        *,
        lazy_restore: bool,
        huge_pages: bool,
        gpu_node: bool,
        note: Note,
        send: Send,
        spawn: Spawn,
        take_gpus: TakeGpus,
        replica_env: ReplicaEnv,
    ) -> None:
        self.snapshotter = snapshotter
        self.lazy_restore = lazy_restore  # where the kernel allows
        self.huge_pages = huge_pages  # where the kernel has them
        self.gpu_node = gpu_node  # replicas see only the GPUs they hold
        self.note = note  # a line into the replica's log
        self.send = send  # to the control plane
        self.spawn = spawn  # a task the agent keeps until it is done
        self.take_gpus = take_gpus
        # The weights files an image maps, whole in this node's cache before its restore.
        self.weights = ImageWeights(snapshotter, note=note, replica_env=replica_env)

    async def fetch_weights_ahead(
        self, command: wire.PrefetchSnapshot, room_for: Callable[[int], bool]
    ) -> str | None:
        """Beside an image fetched ahead, the weights files it maps, if they fit
        (`ImageWeights.fetch_ahead`): a line for the endpoint's log, or None."""
        return await self.weights.fetch_ahead(command, room_for)

    def retake_answered(self, record: RunningReplica | None, command: wire.RetakeSnapshot) -> None:
        """The control plane's answer: may the replica booting cold after its failed
        restore take the new snapshot? A yes that comes too late is declined."""
        key = command.key if command.granted else None
        waiting = record.retake if record is not None else None
        if waiting is not None and not waiting.done():
            waiting.set_result(key)
        elif key is not None:
            self.spawn(self.send(wire.TakeDeclined(key=key, replica_id=command.replica_id)))

    async def restore(
        self,
        record: RunningReplica,
        command: wire.StartReplica,
        snapshot: wire.SnapshotPlan,
        identity: ReplicaIdentity,
        cgroup_procs: Sequence[Path],
        with_gpus: Callable[[list[GpuDevice]], Awaitable[None]] | None = None,
        network: int | None = None,
    ) -> ReplicaProcess | None:
        """Restore the replica from the snapshot its start command names (into the
        network namespace open as `network`, where it has one); None (and a cold boot)
        if that fails. It gets the GPUs the snapshot was taken on when they are
        free, else others of the type, onto which the CUDA driver moves the image's GPU
        state."""
        snapshotter = self.snapshotter
        key, image_id = snapshot.key, snapshot.image_id
        began = time.monotonic()
        pipes: ReplicaPipes | None = None
        try:
            images = await snapshotter.fetch(key, image_id)
            meta = image_meta(images)
            weights_dir = self.weights.objects_for(record.user)
            if weights_dir is not None:
                await self.weights.on_node(record, command, meta, weights_dir)
            fetched = time.monotonic()
            taken_as = meta.get("uid")
            if record.user is not None and taken_as not in (None, record.user.uid):
                # Its snapshot phase's filter lets it drop to that uid alone.
                raise UidMoveError(
                    f"it was taken as uid {taken_as} of its workspace, which is uid "
                    f"{record.user.uid} on this node"
                )
            gpus = self.take_gpus(record, command, meta.get("gpus") or ())
            pairs = self._gpu_moves(meta, gpus)
            if record.sandbox is not None and gpus:
                if any(old != new for old, new in pairs):
                    # Its sandbox's device nodes are the image's GPUs', by number.
                    raise GpuMoveError("a sandboxed image restores onto its own GPUs only")
                if with_gpus is not None:  # their device nodes into its sandbox's plan
                    await with_gpus(gpus)
            pipes = ReplicaPipes.create()
            lazy = restores_lazily(self.lazy_restore, snapshotter.support, meta)
            if self.huge_pages and not lazy:  # pages through userfaultfd come 4 KiB each
                images = await self._huge_page_images(record, key, images)
            mapped = meta.get("mapped_weights") or []
            in_place = (
                linked_in_place(mapped, weights_dir)
                if weights_dir is not None
                else contextlib.nullcontext()
            )
            with in_place:
                process = await snapshotter.restore(
                    images,
                    pipes,
                    lazy=lazy,
                    on_pages_in=lambda seconds, error: self._pages_in(
                        record, (key, image_id), seconds, error
                    ),
                    gpu_pairs=pairs,
                    cgroup_procs=cgroup_procs,
                    sandbox=record.sandbox,
                    network=network,
                )
        except (GpuMoveError, UidMoveError, WeightsNotOnNode) as exc:  # sound: keep it
            self.note(record, f"not restoring snapshot {key[:12]}, booting cold: {exc}")
            return None
        except SnapshotError as exc:
            if pipes is not None:
                pipes.close_all()
            self.note(record, f"restoring snapshot {key[:12]} failed, booting cold: {exc}")
            await self._drop_image(record, key, image_id, str(exc), retake=True)
            return None
        restored = time.monotonic()
        pipes.close_child_ends()
        if record.user is not None and (uid := _uid_of(process.pid)) not in (0, record.user.uid):
            # CRIU restores the image's credentials: a uid another node chose for this
            # workspace (replica_users.py) may be another workspace's here. Root gives
            # itself up on reading its identity (boot.py).
            process.kill()
            await process.wait()
            pipes.close_all()
            self.note(
                record,
                f"snapshot {key[:12]} runs as uid {uid}, not uid {record.user.uid} of its "
                "workspace on this node: booting cold instead",
            )
            return None
        identity = replace(
            identity,
            restored=True,
            fetch_seconds=fetched - began,
            restore_seconds=restored - fetched,
            gpu_restore_seconds=process.gpu_restore_seconds,
            memory_pending=lazy,
            # A gang member's place is this gang's, not the snapshot's.
            env={**command.env, **(gang_env(command.gang) if command.gang else {})} or None,
            replica_pid=process.pid,
            # The image's environment names the snapshot's GPUs: this one holds these.
            cuda_visible_devices=visible_devices(gpus) if self.gpu_node else None,
        )
        os.write(pipes.control, identity.to_line())
        if meta.get("weights") and await self._weights_changed(record, key, process, pipes):
            await process.wait()  # it exits once it has said so; reaped here, never adopted
            pipes.close_all()
            await self._drop_image(
                record, key, image_id, "the weights it holds changed", retake=True
            )
            return None
        return process

    async def _weights_changed(
        self, record: RunningReplica, key: str, process: ReplicaProcess, pipes: ReplicaPipes
    ) -> bool:
        """Whether the restored replica found that weights it read before the snapshot
        changed at their origin since (it asks them before it serves, replica.py): then
        it exits, and a replica booted cold must take its place."""
        status = await open_reader(os.dup(pipes.status))
        try:
            line = await asyncio.wait_for(status.reader.readline(), WEIGHTS_VERDICT_TIMEOUT)
        except TimeoutError:
            self.note(record, "the restored replica did not check its weights in time")
            return False
        except ValueError:  # a line past the reader's limit: not a report of ours
            self.note(record, "the restored replica wrote a status line too long to be one")
            return False
        finally:
            status.close()
        verdict = _status(record, line, wire.WeightsChecked)
        if verdict is None or not verdict.changed:
            return False  # current, or it died (its exit is reported as usual)
        what = "; ".join(f"{c.url}: version {c.was} then, {c.now} now" for c in verdict.changed)
        self.note(
            record,
            f"snapshot {key[:12]} holds weights that changed since it was taken ({what}): "
            "booting cold instead, to take a new snapshot with the new ones",
        )
        process.kill()
        return True

    async def _huge_page_images(self, record: RunningReplica, key: str, images: Path) -> Path:
        """This node's view of the image with its dense memory marked for huge pages
        (huge_pages.py), saying so when it is made; the image as it is if that fails."""
        try:
            view, advice = await asyncio.to_thread(huge_page_images, images)
        except Exception as exc:  # pycriu's decoding errors are of many kinds
            self.note(record, f"snapshot {key[:12]} restores with 4 KiB pages: {exc}")
            return images
        if advice is not None:
            self.note(
                record,
                f"snapshot {key[:12]}: {advice.bytes / 1e6:.0f} MB of its memory "
                f"({advice.mappings} mappings) restores into huge pages on this node",
            )
        return view

    async def _drop_image(
        self, record: RunningReplica, key: str, image_id: str, reason: str, retake: bool = False
    ) -> None:
        """An image a replica could not be restored from: gone from this node, and from
        the control plane (`restore_failed`), so that a fresh one is taken. With
        `retake`, the replica boots cold now and asks to take it (`_take_key`)."""
        self.snapshotter.forget(key, image_id)
        if retake:
            record.retake = asyncio.get_running_loop().create_future()
        failed = wire.RestoreFailed(
            key=key,
            image_id=image_id,
            replica_id=record.replica_id,
            reason=reason[:2000],
            retake=retake,
        )
        await self.send(failed)

    def _gpu_moves(self, meta: dict[str, Any], gpus: list[GpuDevice]) -> list[tuple[str, str]]:
        """The (old, new) GPU UUIDs a restore onto `gpus` needs (GpuMoveError if the
        driver cannot make the move)."""
        cuda = self.snapshotter.cuda
        return restore_moves(
            [str(i) for i in meta.get("gpus") or ()],
            gpus,
            holds_gpu_state=bool(meta.get("cuda")),
            can_remap=cuda is not None and cuda.can_remap,
        )

    def _pages_in(
        self, record: RunningReplica, image: tuple[str, str], seconds: float, error: str | None
    ) -> None:
        """A lazily restored replica has all of its memory, or never will: then it was
        killed (its exit is reported as usual), and the image is dropped as after a failed
        restore, so that the next replica does not restore from it again."""
        key, image_id = image
        if error is None:
            self.note(record, f"lazy restore: all memory in {seconds:.3f} s after the restore")
        else:
            self.note(
                record,
                f"lazy restore failed, the replica was stopped and snapshot {key[:12]} "
                f"dropped: {error}",
            )
        memory_in = wire.ReplicaMemoryIn(replica_id=record.replica_id, seconds=seconds, error=error)

        async def report() -> None:
            if error is not None:
                await self._drop_image(record, key, image_id, f"lazy pages: {error}")
            await self.send(memory_in)

        self.spawn(report())

    async def take_then_release(
        self,
        record: RunningReplica,
        process: ReplicaProcess,
        command: wire.StartReplica,
        identity: ReplicaIdentity,
        gpus: list[GpuDevice],
        dumped: Callable[[], None] | None = None,
    ) -> None:
        """Wait for the replica's quiet point, dump it, let it run on, then publish the
        image: the replica does not wait for the compression and the upload. `dumped`
        is called once it runs on (dumped or not)."""
        snapshotter = self.snapshotter
        status = await open_reader(os.dup(process.pipes.status))
        try:
            line = await status.reader.readline()
        except ValueError:  # a line past the reader's limit: taken for a report that fits none
            line = b"?"
        finally:
            status.close()
        if not line:
            return  # it died before its quiet point; its exit is reported as usual
        key = await self._take_key(record, command)
        if key is None:  # after a failed restore, another replica takes the new image
            with contextlib.suppress(OSError):
                os.write(process.pipes.control, identity.to_line())
            if dumped is not None:
                dumped()
            return
        replica_id, label = record.replica_id, command.label
        quiet = _status(record, line, wire.Quiet)
        weights = [msgspec.to_builtins(read) for read in quiet.weights] if quiet else []
        try:
            meta = await snapshotter.dump(
                key,
                process,
                [gpu.visible_id for gpu in gpus],
                weights=weights,
                sandbox=record.sandbox,
                uid=record.user.uid if record.user is not None else None,
            )
        except SnapshotError as exc:
            if exc.held_killed:  # CRIU hung holding it: it cannot run on
                record.exit_cause = f"its snapshot failed, and it with it: {exc}"
                self.note(record, f"snapshot failed; the replica is lost with it: {exc}")
            else:
                self.note(record, f"snapshot failed; this replica runs on without one: {exc}")
            reason = str(exc)[:2000]
            await self.send(
                wire.SnapshotFailed(key=key, replica_id=replica_id, label=label, reason=reason)
            )
            return
        finally:
            with contextlib.suppress(OSError):
                os.write(process.pipes.control, identity.to_line())
            if dumped is not None:
                dumped()
        carried = meta.get("side_files") or {}
        with_files = (
            f", with {carried['files']} files it uses from outside the worker and system "
            f"folders ({carried['bytes'] / 1e6:.1f} MB)"
            if carried.get("files")
            else ""
        )
        if carried.get("skipped"):
            with_files += f"; too large to carry: {', '.join(carried['skipped'][:3])}"
        mapped = meta.get("mapped_weights") or []
        if mapped:
            # Not in the image: restores map them from the node's weights cache.
            with_files += (
                f"; {total_bytes(mapped) / 1e6:.0f} MB of weights in {len(mapped)} "
                f"file{'s' if len(mapped) > 1 else ''} stay mapped from the node's cache"
            )
        self.note(
            record,
            f"snapshot {key[:12]} taken in {meta['dump_seconds']:.2f} s "
            f"({meta['raw_size'] / 1e6:.0f} MB{with_files}); publishing it",
        )
        image_id = str(meta["image_id"])
        about = {"key": key, "replica_id": replica_id, "label": label, "image_id": image_id}
        await self.send(wire.SnapshotDumped(**about))
        try:
            meta = await snapshotter.publish(key, image_id)
        except SnapshotError as exc:
            snapshotter.forget(key, image_id)
            log.warning("snapshot %s: %s", key[:12], exc)
            await self.send(wire.SnapshotFailed(**about, reason=str(exc)[:2000]))
            return
        log.info(
            "snapshot %s published in %.2f s (%.0f MB compressed)",
            key[:12],
            meta["publish_seconds"],
            meta["size"] / 1e6,
        )
        taken = wire.SnapshotTaken(
            **about,
            bundle_digest=command.bundle_digest,
            size=meta["size"],
            raw_size=meta["raw_size"],
            dump_seconds=meta["dump_seconds"],
        )
        await self.send(taken)

    async def _take_key(self, record: RunningReplica, command: wire.StartReplica) -> str | None:
        """The key of the snapshot this replica takes at its quiet point: the one it was
        started to take, or after its failed restore the one the control plane lets it
        retake (None if another replica does, or the answer is late)."""
        snapshot = command.snapshot
        if snapshot is not None and snapshot.action == "take":
            return snapshot.key
        waiting = record.retake
        if waiting is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), RETAKE_ANSWER_TIMEOUT)
        except TimeoutError:
            waiting.cancel()  # a yes after this is declined (_retake_answered)
            return None


def _uid_of(pid: int) -> int | None:
    """The real uid of a process (None if it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


Report = TypeVar("Report", wire.Quiet, wire.WeightsChecked)


def _status(record: RunningReplica, line: bytes, kind: type[Report]) -> Report | None:
    """The report a replica wrote on its status pipe, if it is one of `kind` (its code is
    untrusted: a line that does not fit is noted and taken for none)."""
    if not line:
        return None
    try:
        report = wire.from_status_pipe(line)
    except wire.WireError as error:
        log.warning("replica %s: a status line that does not fit: %s", record.replica_id, error)
        return None
    return report if isinstance(report, kind) else None
