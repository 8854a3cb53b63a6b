"""What workers and replicas say on their channels, decoded as `ember.wire.messages` types
them and handed to the part it concerns.

A worker: heartbeats (its GPUs, its replicas' memory and CPU waits, the snapshots and
weights it caches), a replica's exit, its leaving, a lazily restored replica's memory
all in, snapshot reports, `ember replica exec` output, and its replicas' logs. A replica:
heartbeats (weights read, user metrics), its engine's metrics, ready, a failed start or
health check, and for each input its events and its end (a result, a stream's end, an
error, a cancel).

A replica runs its user's code, and a worker may be of another release: what they say is
checked, never trusted. A message that does not fit its type, a replica's about an input
it does not run, a worker's about a replica on another worker: each is logged, saying who
sent it and why, and dropped; the channel stays open. Messages to them are sent where the
decision is made, with `Worker.send` and `Replica.send`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any, assert_never

from ember.files import received_file_header
from ember.wire import messages as wire
from ember.wire.limits import MAX_RESULT_BYTES, MIB, RESULT_PIECE_BYTES
from ember_platform.config import ServerConfig
from ember_platform.core.input_lifecycle import InputLifecycle
from ember_platform.core.replica_exec import ExecSessions
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.core.streams import StreamFlow
from ember_platform.core.workers import WorkerRoster
from ember_platform.images.builds import ImageBuilds
from ember_platform.observability.engine_metrics import EngineMetrics
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.cluster_model import AboutInput, Gang, Replica, ReplicaState, Worker
from ember_platform.runtime.inputs import CHUNK, EVENT, Input, Outcome, hold_for
from ember_platform.runtime.live_state import MAX_HELD_MIB, LiveState
from ember_platform.snapshots.events import SnapshotReports

log = logging.getLogger("ember.channels")
# The pieces of the largest result (the replica sends RESULT_PIECE_BYTES in each).
MAX_RESULT_PIECES = MAX_RESULT_BYTES // RESULT_PIECE_BYTES


class ChannelMessages:
    def __init__(
        self,
        state: LiveState,
        config: ServerConfig,
        replicas: ReplicaLifecycle,
        inputs: InputLifecycle,
        streams: StreamFlow,
        roster: WorkerRoster,
        reports: SnapshotReports,
        execs: ExecSessions,
        logs: LogSink,
        metrics: PlatformMetrics,
        engine_metrics: EngineMetrics,
        image_builds: ImageBuilds | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self.replicas = replicas
        self.inputs = inputs
        self.streams = streams
        self.roster = roster
        self.reports = reports
        self.execs = execs
        self.logs = logs
        self.metrics = metrics
        self.engine_metrics = engine_metrics
        self.image_builds = image_builds

    # ----- from workers ------------------------------------------------------------
    def _gpu_health(self, worker: Worker, health: list[wire.GpuHealth]) -> None:
        """The node's GPUs' health. A fenced GPU's replicas drain (they finish what they
        run, then stop) and are replaced elsewhere; those of a GPU lost from the bus are
        replaced at once, their inputs retried as a lost replica's are."""
        worker.gpu_health = health
        for gpu in health:
            if not gpu.fenced:
                continue
            why = f"GPU {gpu.index} of node {worker.name} failed: {'; '.join(gpu.reasons)}"
            for replica_id in gpu.replicas:
                replica = self.state.replicas.get(replica_id)
                if replica is None or replica.worker_id != worker.id:
                    continue  # a worker speaks only of its own replicas
                if gpu.lost:
                    self.inputs.replica_lost(replica, why, startup_failure=False)
                elif replica.state in (ReplicaState.STARTING, ReplicaState.READY):
                    runtime = replica.endpoint
                    self.logs.system(runtime.app, runtime.spec.name, why, replica.id)
                    self.replicas.drain(replica)
                    self.state.wake.set()  # its replacement starts now

    def from_worker(self, worker: Worker, text: str | bytes) -> None:
        """One message of a worker's channel (the text of its frame)."""
        worker.last_seen = time.time()
        try:
            message = wire.from_agent(text)
        except wire.WireError as error:
            _worker_dropped(worker, str(error))
            return
        match message:
            case wire.AgentHeartbeat():
                self._worker_heartbeat(worker, message)
            case wire.ReplicaExited():
                self._replica_exited(worker, message)
            case wire.Leaving():
                self.roster.leaving(worker)
            case wire.ReplicaMemoryIn():
                self._memory_in(worker, message)
            case (
                wire.SnapshotDumped()
                | wire.SnapshotTaken()
                | wire.SnapshotFailed()
                | wire.TakeDeclined()
                | wire.RestoreFailed()
            ):
                self.reports.report(worker, message)
            case wire.ExecOutput() | wire.ExecExit():
                self.execs.message(worker, message)
            case wire.Logs():
                self._logs(message)
            case wire.ImageBuildOutput() | wire.ImageBuildDone():
                if self.image_builds is not None:
                    self.image_builds.message(worker, message)
            case wire.Hello():
                _worker_dropped(worker, "a hello, but it joined already")
            case _:
                assert_never(message)

    def _worker_heartbeat(self, worker: Worker, beat: wire.AgentHeartbeat) -> None:
        worker.gpu_samples = beat.gpus or []
        worker.booked = beat.booked  # its replicas' share, those of others too
        self._gpu_health(worker, beat.gpu_health or [])
        for replica_id, used in (beat.replica_memory or {}).items():  # of its own only
            replica = self.state.replicas.get(replica_id)
            if replica is not None and replica.worker_id == worker.id:
                replica.memory_bytes = used
        for replica_id, waited in (beat.replica_cpu_throttled or {}).items():
            replica = self.state.replicas.get(replica_id)
            if replica is not None and replica.worker_id == worker.id:
                replica.cpu_throttled_seconds = waited
        if beat.cached_snapshots is not None:  # sent when it changed
            worker.cached_snapshots = {
                (pair[0], pair[1]) for pair in beat.cached_snapshots if len(pair) == 2
            }
        if beat.cached_weights is not None:  # sent when it changed
            worker.cached_weights = beat.cached_weights

    def _replica_exited(self, worker: Worker, report: wire.ReplicaExited) -> None:
        self.state.gang_member_ended(report.replica_id, worker.id)  # its ports, once all are
        replica = self._replica_on(worker, report.replica_id)
        if replica is None:
            return
        detail = report.detail or f"exit code {report.returncode}"
        if report.no_room or report.node_full:
            # No GPU free after all, or CPUs or memory booked by replicas this process does
            # not know of: not the endpoint's failure; taken until its next heartbeat.
            now = time.time()
            worker.gpus_refused_at = now if report.no_room else worker.gpus_refused_at
            worker.room_refused_at = now if report.node_full else worker.room_refused_at
            self.inputs.replica_lost(replica, detail, startup_failure=False)
        elif replica.state is ReplicaState.STOPPING and not replica.inflight:
            self.replicas.forget(replica)
        else:
            self.inputs.replica_lost(replica, f"its process ended ({detail})", crashed=True)

    def _memory_in(self, worker: Worker, report: wire.ReplicaMemoryIn) -> None:
        """A lazily restored replica's memory is all in: part of how it started, and what
        it held about its inputs meanwhile now counts."""
        replica = self._replica_on(worker, report.replica_id)
        if replica is None or report.error:
            return
        seconds = round(report.seconds, 4)
        replica.start["memory_in_seconds"] = seconds
        if replica.state is not ReplicaState.STARTING:  # else counted at `ready`
            self.replicas.start_phase(replica, "memory_in", seconds)
        for message, body in self.state.take_early(replica):
            self._about_input(replica, message, body)

    def _replica_on(self, worker: Worker, replica_id: str) -> Replica | None:
        """The replica a worker reports on, if it runs there (gone: None, quietly)."""
        replica = self.state.replicas.get(replica_id)
        if replica is not None and replica.worker_id != worker.id:
            _worker_dropped(worker, f"it spoke of replica {replica_id}, which runs elsewhere")
            return None
        return replica

    def _logs(self, batch: wire.Logs) -> None:
        by_app: dict[str, list[dict[str, Any]]] = {}
        for entry in batch.entries:
            by_app.setdefault(str(entry.get("app", "")), []).append(entry)
            dropped = entry.get("dropped")  # a node's marker of output it did not ship
            if isinstance(dropped, int) and dropped > 0:
                endpoint = str(entry.get("endpoint", ""))
                self.metrics.log_lines_dropped_by(str(entry.get("app", "")), endpoint, dropped)
        for app, entries in by_app.items():
            if app:
                self.logs.write(app, entries)

    # ----- from replicas -----------------------------------------------------------
    def from_replica(self, replica: Replica, text: str) -> None:
        """One message of a replica's channel (a record of its frame)."""
        replica.last_seen = time.time()
        try:
            message, body = wire.from_replica(text)
        except wire.WireError as error:
            replica.mid_result = False
            _replica_dropped(replica, str(error))
            return
        replica.mid_result = isinstance(message, wire.ResultPart)
        match message:
            case wire.ReplicaHeartbeat():
                runtime = replica.endpoint
                if message.weights is not None:
                    self.metrics.weights_read(
                        replica.id, runtime.app, runtime.spec.name, message.weights
                    )
                if message.metrics is not None:
                    self.metrics.user.report(
                        replica.id, runtime.app, runtime.spec.name, message.metrics
                    )
            case wire.EngineMetrics():
                runtime = replica.endpoint
                if runtime.settings.engine_metrics is None:  # else it may send none
                    return
                try:
                    self.engine_metrics.report(
                        replica.id, runtime.app, runtime.spec.name, message, body
                    )
                except wire.WireError as error:
                    _replica_dropped(replica, f"engine metrics: {error}")
            case wire.Ready():
                self._replica_ready(replica, message.start)
            case wire.StartupFailed():
                self.inputs.startup_failed(
                    replica.endpoint, f"{message.error_type}: {message.message}"
                )
                self.inputs.replica_lost(replica, "its enter() hook failed", startup_failure=False)
            case wire.Unhealthy():
                self.replicas.unhealthy(replica, message.reason)
            case (
                wire.Event()
                | wire.Result()
                | wire.ResultPart()
                | wire.End()
                | wire.Error()
                | wire.Cancelled()
            ):
                self._about_input(replica, message, body)
            case _:
                assert_never(message)

    def _about_input(self, replica: Replica, message: AboutInput, body: str) -> None:
        if replica.held is not None:
            if not self.state.hold_early(replica, message, body):
                why = f"it sent over {MAX_HELD_MIB} MiB about its inputs before its memory was in"
                self.inputs.replica_lost(replica, why, startup_failure=False)
            return
        if replica.gang is not None and replica is not replica.gang.lead:
            self._member_about_input(replica.gang, replica, message)
            return
        inp = replica.inflight.get(message.id)
        if inp is None:
            other = self.state.inputs.get(message.id)
            if other is not None and other.replica_id != replica.id:
                _replica_dropped(replica, f"input {message.id} is not one it runs")
            return  # else finished already (timeout, cancel): late output is dropped
        if isinstance(message, wire.Event):
            self._input_event(replica, inp, message, body)
            return
        if isinstance(message, wire.ResultPart):
            self._result_part(replica, inp, body.encode())
            return
        if inp.done:  # stopped (a cancel, a peer's error): its late end frees the slot
            del replica.inflight[inp.id]
            inp.disarm()
            self._slot_freed(replica)
            return
        data: bytes | bytearray = body.encode()
        if inp.result_pieces:
            inp.result_parts += data  # its last piece: the whole is answered as it is
            data, inp.result_parts, inp.result_pieces = inp.result_parts, bytearray(), 0
        hold_for(self.state.answers, inp, len(data))  # until its caller has it, or its record
        if isinstance(message, wire.Result) and message.media_type is not None:
            file = _base64(replica, inp, bytes(data))  # a file: base64 on the channel
            if file is None:
                return
            data = file
        del replica.inflight[inp.id]
        inp.disarm()  # its lease: it answered
        if replica.served == 0 and inp.dispatched_at is not None:
            # The first input shows what is still cold after a start (lazy init, caches).
            seconds = round(time.time() - inp.dispatched_at, 4)
            replica.start["first_input_seconds"] = seconds
            self.replicas.start_phase(replica, "first_input", seconds)
        replica.served += 1
        self._input_ended(inp, message, data)
        self._slot_freed(replica)

    def _member_about_input(self, gang: Gang, member: Replica, message: AboutInput) -> None:
        """A gang member's word on its copy of one of the lead's inputs (every_rank): rank
        0's result is the answer, so of the copy only a failure counts, as the call's.
        Nothing of what it sends is kept."""
        copies = gang.copies.get(member.id, set())
        if message.id not in copies:
            return  # not a copy it runs: dropped
        if isinstance(message, wire.Result | wire.End | wire.Error | wire.Cancelled):
            copies.discard(message.id)  # its copy ended: room for rank 0's next
            if gang.lead.state is ReplicaState.READY and not gang.behind():
                self.inputs.queues.dispatch(gang.lead.endpoint)
        inp = gang.lead.inflight.get(message.id)
        if inp is None or inp.done:
            return  # ended already: dropped
        if isinstance(message, wire.Error):
            failed = f"rank {member.rank} of its gang: {message.message}"
            self.inputs.stop(inp, Outcome.error(message.status, message.error_type, failed))
        elif isinstance(message, wire.Cancelled):
            # Only the platform cancels, and then the input ended: this copy stopped by
            # itself, and rank 0 would wait for ever for the step it skipped.
            failed = f"rank {member.rank} of its gang stopped the input by itself"
            self.inputs.stop(inp, Outcome.error(500, "CancelledError", failed))

    def _result_part(self, replica: Replica, inp: Input, data: bytes) -> None:
        """A piece of a large result, kept until the rest comes; counted as held once
        whole. A replica's code is untrusted: the pieces are bounded, at most as many as
        the largest result has, and at most one result's worth held of all its inputs
        (a replica sends one result in pieces at a time)."""
        if inp.done:
            return  # stopped: the rest of it is dropped
        pieces = sum(len(other.result_parts) for other in replica.inflight.values())
        if inp.result_pieces >= MAX_RESULT_PIECES or pieces + len(data) > MAX_RESULT_BYTES:
            inp.result_parts, inp.result_pieces = bytearray(), 0
            message = (
                f"{inp.label} sent more than {MAX_RESULT_BYTES // MIB} MiB of one result, "
                f"or in more than {MAX_RESULT_PIECES} pieces"
            )
            self.inputs.stop(inp, Outcome.error(500, "result_too_large", message))
            return
        inp.result_parts += data
        inp.result_pieces += 1

    def _input_event(self, replica: Replica, inp: Input, event: wire.Event, body: str) -> None:
        """An event of a stream the input's code yields."""
        if inp.done:
            return  # stopped (timeout, cancel): only its end still counts, for the slot
        event_kind, data = EVENT, body.encode()
        if event.media_type is not None:  # a chunk of a stream that is a file
            chunk = _base64(replica, inp, data)
            if chunk is None:
                return
            event_kind, data = CHUNK, chunk
            if inp.file is None:
                inp.file = _file_of(event)
        inp.emitted = True
        hold_for(self.state.answers, inp, len(data))  # until its caller takes it
        if inp.is_async:
            self.streams.collect(inp, data, len(body))
        else:
            inp.add_event(event_kind, data, len(body))

    def _input_ended(
        self,
        inp: Input,
        end: wire.Result | wire.End | wire.Error | wire.Cancelled,
        body: bytes | bytearray,
    ) -> None:
        match end:
            case wire.Result() if end.media_type is not None:  # `body` decoded already
                self.inputs.finish(inp, Outcome(200, body, *_file_of(end)))
            case wire.Result():
                self.inputs.finish(inp, Outcome(200, body))
            case wire.End() if inp.is_async and inp.file is not None:
                # A spawned call's file stream is kept as one file.
                self.inputs.finish(inp, Outcome(200, b"".join(inp.collected), *inp.file))
            case wire.End():
                payload = b"[" + b",".join(inp.collected) + b"]" if inp.is_async else b""
                self.inputs.finish(inp, Outcome(200, payload))
            case wire.Error():
                status, error_type, message = end.status, end.error_type, end.message
                if not self.inputs.retry_after_error(inp, status, error_type, message):
                    fields = (
                        {"param": end.param, "code": end.code}
                        if end.param is not None or end.code is not None
                        else None
                    )
                    self.inputs.finish(inp, Outcome.error(status, error_type, message, fields))
            case wire.Cancelled() if not inp.done:
                # Only the platform cancels (the input ended then); this one the replica
                # stopped by itself, and its caller must not wait for ever.
                message = f"{inp.label}: the replica stopped the input without being asked to"
                self.inputs.finish(inp, Outcome.error(500, "CancelledError", message))
            case wire.Cancelled():
                pass
            case _:
                assert_never(end)

    def _replica_ready(self, replica: Replica, start: wire.StartReport) -> None:
        serving = self.replicas.ready(replica, start)  # its gang's first, for a member
        if serving is None:
            return
        replica = serving
        runtime = replica.endpoint
        if replica.version != runtime.version or runtime.removed:
            self.replicas.drain(replica)
        else:
            self.inputs.queues.dispatch(runtime)

    def _slot_freed(self, replica: Replica) -> None:
        if not replica.inflight:
            replica.idle_since = time.time()
            if replica.state is ReplicaState.DRAINING:
                self.replicas.stop(replica)
                return
        if replica.state is ReplicaState.READY:
            self.inputs.queues.dispatch(replica.endpoint)

    # ----- channels closing --------------------------------------------------------
    def replica_disconnected(self, replica: Replica) -> None:
        replica.outbox = None
        if replica.id not in self.state.replicas:
            return
        if replica.state is ReplicaState.STOPPING and not replica.inflight:
            # Kept until its worker reports the process gone: until then it still holds
            # the node's CPU, memory and GPUs, which must not be handed to a new replica.
            return
        # Mostly the process ended, and its worker's report of how (an exit code, a
        # signal, the OOM killer) comes within milliseconds: callers and logs get that
        # rather than a closed connection. No input is sent to it meanwhile (no outbox).
        grace = self.config.exit_report_grace_seconds
        if grace <= 0:
            self._channel_lost(replica)
        elif replica.disconnect_timer is None:
            loop = asyncio.get_running_loop()
            replica.disconnect_timer = loop.call_later(grace, self._channel_lost, replica)

    def _channel_lost(self, replica: Replica) -> None:
        replica.disconnect_timer = None
        if self.state.replicas.get(replica.id) is replica:
            self.inputs.replica_lost(
                replica, "its connection to the control plane closed", crashed=True
            )


def _file_of(header: wire.Event | wire.Result) -> tuple[str, str | None]:
    """The media type and name of a file a replica sends, checked again here."""
    return received_file_header({"media_type": header.media_type, "filename": header.filename})


def _base64(replica: Replica, inp: Input, data: bytes) -> bytes | None:
    """A file's bytes from their base64 on the channel; None (logged) if they are not."""
    try:
        return base64.b64decode(data)
    except binascii.Error as error:
        _replica_dropped(replica, f"input {inp.id}'s file is not base64 ({error})")
        return None


def _worker_dropped(worker: Worker, why: str) -> None:
    log.warning("dropped a message from worker %s (%s): %s", worker.name, worker.id, why)


def _replica_dropped(replica: Replica, why: str) -> None:
    label = replica.endpoint.label
    log.warning("dropped a message from replica %s of %s: %s", replica.id, label, why)
