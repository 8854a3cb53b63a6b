"""What workers and replicas say on their channels, read in one place and handed to the
part it concerns.

A worker: heartbeats (its GPUs, its replicas' memory and CPU waits, the snapshots and
weights it caches), a replica's exit, its leaving, a lazily restored replica's memory
all in, snapshot reports, `ember replica exec` output, and its replicas' logs. A replica:
heartbeats (weights read, user metrics), ready, a failed start or health check, and for
each input its events and its end (a result, a stream's end, an error, a cancel).
Messages to them are sent where the decision is made, with `Worker.send` and `frame`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

from ember.files import received_file_header
from ember_platform.config import ServerConfig
from ember_platform.core.cluster_model import Replica, ReplicaState, Worker
from ember_platform.core.input_lifecycle import InputLifecycle
from ember_platform.core.inputs import CHUNK, EVENT, Input, Outcome
from ember_platform.core.live_state import LiveState
from ember_platform.core.replica_exec import ExecSessions
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.core.streams import StreamFlow
from ember_platform.core.workers import WorkerRoster
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.snapshots.events import QUIET_SNAPSHOT_REPORTS, SNAPSHOT_EVENTS, SnapshotReports


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

    # ----- from workers ------------------------------------------------------------
    def from_worker(self, worker: Worker, payload: dict[str, Any]) -> None:
        worker.last_seen = time.time()
        kind = payload.get("type")
        if kind == "heartbeat":
            self._worker_heartbeat(worker, payload)
        elif kind == "replica_exited":
            replica = self.state.replicas.get(str(payload.get("replica_id")))
            if replica is not None:
                detail = payload.get("detail") or f"exit code {payload.get('returncode')}"
                if replica.state is ReplicaState.STOPPING and not replica.inflight:
                    self.replicas.forget(replica)
                else:
                    self.inputs.replica_lost(replica, f"its process ended ({detail})", crashed=True)
        elif kind == "leaving":
            self.roster.leaving(worker)
        elif kind == "replica_memory_in":
            # A lazily restored replica's memory is all in: part of how it started.
            replica = self.state.replicas.get(str(payload.get("replica_id")))
            if replica is not None and not payload.get("error"):
                seconds = round(float(payload["seconds"]), 4)
                replica.start["memory_in_seconds"] = seconds
                if replica.state is not ReplicaState.STARTING:  # else counted at `ready`
                    self.replicas.start_phase(replica, "memory_in", seconds)
                held, replica.held = replica.held or [], None
                for text in held:
                    self.from_replica(replica, text)
        elif kind in SNAPSHOT_EVENTS or kind in QUIET_SNAPSHOT_REPORTS:
            self.reports.report(worker, kind, payload)
        elif kind in ("exec_output", "exec_exit"):
            self.execs.message(worker, payload)
        elif kind == "logs":
            by_app: dict[str, list[dict[str, Any]]] = {}
            for entry in payload.get("entries", []):
                by_app.setdefault(str(entry.get("app", "")), []).append(entry)
            for app, entries in by_app.items():
                if app:
                    self.logs.write(app, entries)

    def _worker_heartbeat(self, worker: Worker, payload: dict[str, Any]) -> None:
        worker.gpu_samples = [g for g in payload.get("gpus") or [] if isinstance(g, dict)]
        for replica_id, used in dict(payload.get("replica_memory") or {}).items():
            replica = self.state.replicas.get(str(replica_id))
            if replica is not None and replica.worker_id == worker.id and type(used) is int:
                replica.memory_bytes = used
        for replica_id, waited in dict(payload.get("replica_cpu_throttled") or {}).items():
            replica = self.state.replicas.get(str(replica_id))
            if (
                replica is not None
                and replica.worker_id == worker.id
                and isinstance(waited, int | float)
            ):
                replica.cpu_throttled_seconds = float(waited)
        cached = payload.get("cached_snapshots")
        if isinstance(cached, list):  # sent when it changed
            worker.cached_snapshots = {
                (str(pair[0]), str(pair[1]))
                for pair in cached
                if isinstance(pair, list) and len(pair) == 2
            }
        weights = payload.get("cached_weights")
        if isinstance(weights, dict):  # sent when it changed
            worker.cached_weights = {
                str(url): size for url, size in weights.items() if type(size) is int
            }

    # ----- from replicas -----------------------------------------------------------
    def from_replica(self, replica: Replica, text: str) -> None:
        replica.last_seen = time.time()
        header_text, _, body = text.partition("\n")
        header = json.loads(header_text)
        kind = header["type"]
        if kind == "heartbeat":
            runtime = replica.endpoint
            weights = header.get("weights")
            if isinstance(weights, dict):
                self.metrics.weights_read(replica.id, runtime.app, runtime.spec.name, weights)
            user = header.get("metrics")
            if isinstance(user, list):
                self.metrics.user.report(replica.id, runtime.app, runtime.spec.name, user)
            return
        if kind == "ready":
            self._replica_ready(replica, dict(header.get("start") or {}))
            return
        if kind == "startup_failed":
            message = f"{header.get('error_type', 'Error')}: {header.get('message', '')}"
            self.inputs.startup_failed(replica.endpoint, message)
            self.inputs.replica_lost(replica, "its enter() hook failed", startup_failure=False)
            return
        if kind == "unhealthy":
            self.replicas.unhealthy(replica, str(header.get("reason", "")))
            return
        if replica.held is not None:
            replica.held.append(text)
            return
        inp = replica.inflight.get(header.get("id", ""))
        if inp is None:
            return  # finished already (timeout, cancel): late output is dropped
        if kind == "event":
            self._input_event(inp, header, body)
            return
        del replica.inflight[inp.id]
        if inp.timer is not None:
            inp.timer.cancel()
        if replica.served == 0 and inp.dispatched_at is not None:
            # The first input shows what is still cold after a start (lazy init, caches).
            seconds = round(time.time() - inp.dispatched_at, 4)
            replica.start["first_input_seconds"] = seconds
            self.replicas.start_phase(replica, "first_input", seconds)
        replica.served += 1
        self._input_ended(inp, kind, header, body.encode())
        self._slot_freed(replica)

    def _input_event(self, inp: Input, header: dict[str, Any], body: str) -> None:
        """An event of a stream the input's code yields."""
        if inp.done:
            return  # stopped (timeout, cancel): only its end still counts, for the slot
        inp.emitted = True
        event_kind, data = EVENT, body.encode()
        if "media_type" in header:  # a chunk of a stream that is a file
            event_kind, data = CHUNK, base64.b64decode(data)
            if inp.file is None:
                inp.file = received_file_header(header)
        if inp.is_async:
            self.streams.collect(inp, data, len(body))
        else:
            inp.add_event(event_kind, data, len(body))

    def _input_ended(self, inp: Input, kind: str, header: dict[str, Any], body: bytes) -> None:
        if kind == "result" and "media_type" in header:  # a file: base64 on the channel
            self.inputs.finish(
                inp, Outcome(200, base64.b64decode(body), *received_file_header(header))
            )
        elif kind == "result":
            self.inputs.finish(inp, Outcome(200, body))
        elif kind == "end" and inp.is_async and inp.file is not None:
            # A spawned call's file stream is kept as one file.
            self.inputs.finish(inp, Outcome(200, b"".join(inp.collected), *inp.file))
        elif kind == "end":
            payload = b"[" + b",".join(inp.collected) + b"]" if inp.is_async else b""
            self.inputs.finish(inp, Outcome(200, payload))
        elif kind == "error":
            status, error_type = int(header.get("status", 500)), header["error_type"]
            if not self.inputs.retry_after_error(inp, status, error_type, header["message"]):
                self.inputs.finish(inp, Outcome.error(status, error_type, header["message"]))
        elif kind == "cancelled" and not inp.done:
            # Only the platform cancels (the input ended then); this one the replica
            # stopped by itself, and its caller must not wait for ever.
            message = f"{inp.label}: the replica stopped the input without being asked to"
            self.inputs.finish(inp, Outcome.error(500, "CancelledError", message))

    def _replica_ready(self, replica: Replica, start: dict[str, Any]) -> None:
        if not self.replicas.ready(replica, start):
            return
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
