"""The OpenAI Batch API's batches, run by the process that owns the platform.

A batch's requests run as spawned calls of its endpoint at the lowest priority, fed in
only as fast as the endpoint's ready replicas have room that online calls leave (room.py):
an endpoint's batches go one at a time, oldest first. What survives a restart or a
failover is in the state store: the batch (its OpenAI object and the next line to
submit) and each submitted request's call record, whose id is the batch's and the
request's index. A new owner takes each unfinished batch up from them: requests that had
ended are counted from their records, those queued or running are submitted again, and
nothing is submitted twice or left out. The output and error files are made from the
records once every request has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ember_platform.batches.documents import (
    answered_line,
    batch_object,
    encoded,
    error_line,
    failed_validation,
    new_batch,
)
from ember_platform.batches.input_files import InputFile, TooManyLines, read_input_file
from ember_platform.batches.openai_files import BLOB_PREFIX, OpenAIFiles
from ember_platform.batches.room import OnlinePeak, batch_room
from ember_platform.core.cluster import Cluster
from ember_platform.errors import PlatformError
from ember_platform.runtime.cluster_model import EndpointRuntime, ReplicaState
from ember_platform.runtime.inputs import (
    BATCH_CALL_PREFIX,
    BATCH_PRIORITY,
    Input,
    Outcome,
)
from ember_platform.scaling.prefix_routing import block_hashes, prompt_text
from ember_platform.security.random_ids import random_bytes
from ember_platform.storage.records import BatchRecord, CallRecord, OpenAIFileRecord
from ember_platform.storage.state_store import StoreWriteError

log = logging.getLogger("ember.batches")

TICK_SECONDS = 0.05  # as the controller's: slots a batch request frees are filled soon
CANCELLED = "the batch was cancelled"


def request_call_id(batch_id: str, index: int) -> str:
    return f"{batch_id}-{index}"


@dataclass
class Running:
    """An unfinished batch, as the runner holds it."""

    record: BatchRecord
    document: dict[str, Any]
    input: InputFile | None = None  # read while it has requests to submit or to end
    inflight: set[str] = field(default_factory=set)  # its calls not ended yet
    ending: str | None = None  # "cancelled" or "expired" once nothing runs
    changed: bool = False  # its record is to be written

    @property
    def status(self) -> str:
        status: str = self.document["status"]
        return status


class BatchRunner:
    def __init__(self, cluster: Cluster, files: OpenAIFiles, max_requests: int) -> None:
        self.cluster = cluster
        self.files = files
        self.max_requests = max_requests
        self._running: dict[str, Running] = {}
        self._online: dict[str, OnlinePeak] = {}  # by label, of the endpoints with batches
        self.wake = asyncio.Event()

    def take_up(self) -> int:
        """The batches a previous control-plane process left unfinished (their requests
        are submitted again by the ticks, once their input is read)."""
        for record in self.cluster.store.unfinished_batches():
            running = Running(record, batch_object(record))
            if running.status == "cancelling":
                running.ending = "cancelled"
            self._running[record.id] = running
        return len(self._running)

    async def create(
        self,
        label: str,
        input_file: str,
        endpoint: str,
        window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        """A batch of the file's requests, checked (its object says `failed` for a
        custom_id used twice); ValueError when it has no request or too many."""
        record = self.files.of(label, input_file)
        if record is None:
            raise LookupError(f"no file {input_file} at this endpoint")
        parsed = await self._parsed(record, endpoint)
        if parsed.duplicate is None and parsed.total == 0:
            raise ValueError(f"{input_file} holds no request")
        now = time.time()
        batch_id = BATCH_CALL_PREFIX + random_bytes(12).hex()
        document = new_batch(batch_id, endpoint, input_file, window, metadata, now)
        if parsed.duplicate is not None:
            failed_validation(document, parsed.duplicate, now)
        else:
            document["status"] = "in_progress"
            document["in_progress_at"] = int(now)
            document["request_counts"]["total"] = parsed.total
            document["request_counts"]["failed"] = len(parsed.errors)  # lines that fail alone
        batch = BatchRecord(batch_id, label, document["status"], json.dumps(document), 0, now)
        self.cluster.store.put_batch(batch)  # StoreWriteError: refused, nothing promised
        if document["status"] == "in_progress":
            # Its input is read again when its turn comes: waiting batches hold no input.
            self._running[batch_id] = Running(batch, document)
            self.wake.set()
        return document

    async def _parsed(self, record: OpenAIFileRecord, endpoint: str) -> InputFile:
        """The file read, in a thread; ValueError past the server's limit on requests."""
        data = await asyncio.to_thread(self.files.content, record)
        try:
            return await asyncio.to_thread(read_input_file, data, endpoint, self.max_requests)
        except TooManyLines:
            raise ValueError(
                f"{record.id} holds more than {self.max_requests} requests; a batch takes "
                f"at most {self.max_requests} (ember server --batch-max-requests)"
            ) from None

    def forget_workspace(self, workspace: str) -> None:
        """A workspace being removed: its batches stop here (their queued requests too)
        and write nothing more, and its files' bytes leave the blob store (its rows go
        with the workspace's)."""
        prefix = workspace + "--"
        for batch_id, running in list(self._running.items()):
            if running.record.label.startswith(prefix):
                del self._running[batch_id]
                for call_id in running.inflight:
                    inp = self.cluster.inputs.get(call_id)
                    if inp is not None:
                        stopped = Outcome.error(499, "cancelled", "its workspace was removed")
                        self.cluster.input_lifecycle.stop(inp, stopped)
        for file_id in self.cluster.store.openai_files_of_workspace(workspace):
            self.files.blobs.delete(BLOB_PREFIX + file_id)

    def get(self, label: str, batch_id: str) -> dict[str, Any] | None:
        running = self._running.get(batch_id)
        if running is not None:
            return running.document if running.record.label == label else None
        record = self.cluster.store.get_batch(batch_id)
        return batch_object(record) if record is not None and record.label == label else None

    def listing(self, label: str, limit: int) -> list[dict[str, Any]]:
        listed = []
        for record in self.cluster.store.list_batches(label, limit):
            running = self._running.get(record.id)
            listed.append(running.document if running is not None else batch_object(record))
        return listed

    def cancel(self, label: str, batch_id: str) -> dict[str, Any] | None:
        """Its queued requests stopped, those running let finish; then `cancelled`, with
        the results it has. None if the endpoint has no such batch."""
        running = self._running.get(batch_id)
        if running is None or running.record.label != label:
            return self.get(label, batch_id)  # ended already: cancelling changes nothing
        if running.status == "in_progress":
            running.document["status"] = "cancelling"
            running.document["cancelling_at"] = int(time.time())
            running.ending = "cancelled"
            self._stop_queued(running)
            self._write(running)
            self.wake.set()
        return running.document

    async def run(self) -> None:
        while True:
            try:
                await self.tick(time.time())
            except Exception:  # a bug of ours: logged, and the next tick tries again
                log.exception("batches: a tick failed")
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK_SECONDS)

    async def tick(self, now: float) -> None:
        """Each unfinished batch a step on, each apart (one that fails, fails alone): its
        ended requests counted, more submitted (the oldest batch of each endpoint), or
        its files made once nothing of it runs."""
        fed: set[str] = set()
        for running in sorted(self._running.values(), key=lambda r: r.record.created_at):
            try:
                await self._step(running, now, fed)
            except Exception as error:  # a bug, or what a tenant's data made of one
                log.exception("batches: %s failed", running.record.id)
                await self._fail(running, "internal_error", f"the batch failed: {error}"[:300])

    async def _step(self, running: Running, now: float, fed: set[str]) -> None:
        if running.record.id not in self._running:
            return  # its workspace was removed while an earlier batch's step waited
        self._count_ended(running)
        expired = now >= running.document["expires_at"]
        if running.ending is None and running.status == "in_progress" and expired:
            running.ending = "expired"
            self._stop_queued(running)
        if running.ending is None and running.record.label not in fed:
            fed.add(running.record.label)  # this endpoint's batch of the moment
            if running.input is None:
                await self._read_input(running)
                if running.ending is not None:  # cut short before a restart: it ends next
                    return
            assert running.input is not None
            if running.record.next_line < len(running.input.requests):
                self._feed(running, now)
            elif not running.inflight:
                await self._finish(running, now)
        elif running.ending is not None and not running.inflight:
            if running.input is None:
                await self._read_input(running)
                if running.inflight:  # taken up with requests unfinished: counted first
                    return
            await self._finish(running, now)
        if running.changed and running.record.id in self._running:
            self._write(running)

    async def _fail(self, running: Running, code: str, message: str) -> None:
        """The batch ends `failed`, saying why; its queued requests are stopped."""
        self._stop_queued(running)
        running.document["errors"] = {
            "object": "list",
            "data": [{"code": code, "message": message}],
        }
        running.document["status"] = "failed"
        running.document["failed_at"] = int(time.time())
        if self._running.pop(running.record.id, None) is not None:  # not a removed one
            self._write(running)

    async def _read_input(self, running: Running) -> None:
        """The batch's input read when its turn comes (or it ends). For one taken up after
        a restart, its requests that had ended are counted and those that had not are
        submitted again (at the same call id)."""
        record = self.files.of(running.record.label, running.document["input_file_id"])
        if record is None:
            running.input = InputFile()
            running.ending = "failed"
            running.document["errors"] = {
                "object": "list",
                "data": [{"code": "file_not_found", "message": "its input file was deleted"}],
            }
            return
        parsed = await self._parsed(record, running.document["endpoint"])
        running.input = parsed
        calls = self.cluster.calls
        # Accepted before the restart, but not yet written as submitted.
        while running.record.next_line < len(parsed.requests) and calls.get(
            request_call_id(running.record.id, running.record.next_line)
        ):
            running.record.next_line += 1
            running.changed = True
        if running.status == "finalizing" and running.record.next_line < len(parsed.requests):
            # Cut short before a restart: by its window, or by a cancel.
            expired = time.time() >= running.document["expires_at"]
            running.ending = running.ending or ("expired" if expired else "cancelled")
        runtime = self.cluster.endpoints.get(running.record.label)
        for request in parsed.requests[: running.record.next_line]:
            call_id = request_call_id(running.record.id, request.index)
            call = calls.get(call_id)
            if call is not None and call.status.finished:
                continue
            running.inflight.add(call_id)
            if call_id in self.cluster.inputs:
                continue  # still here (taken up twice in one process: never lost)
            if runtime is None or running.ending is not None:
                continue  # counted as failed below, its record says why
            self._submit(running, runtime, request.index, request.body, recovered=True)
        self._recount(running)

    def _recount(self, running: Running) -> None:
        """request_counts from the records of the requests that ended."""
        assert running.input is not None
        completed = failed = 0
        for request in running.input.requests[: running.record.next_line]:
            call = self.cluster.calls.get(request_call_id(running.record.id, request.index))
            if call is None or not call.status.finished:
                continue
            if call.http_status == 200:
                completed += 1
            else:
                failed += 1
        counts = running.document["request_counts"]
        counts["completed"], counts["failed"] = completed, failed + len(running.input.errors)
        running.changed = True

    def _count_ended(self, running: Running) -> None:
        ended = [call_id for call_id in running.inflight if call_id not in self.cluster.inputs]
        if not ended:
            return
        counts = running.document["request_counts"]
        for call_id in ended:
            running.inflight.discard(call_id)
            call = self.cluster.calls.get(call_id)
            if call is not None and call.http_status == 200:
                counts["completed"] += 1
            elif not (running.ending == "cancelled" and call is not None and _never_ran(call)):
                counts["failed"] += 1
        running.changed = True

    def _feed(self, running: Running, now: float) -> None:
        """As many requests as the endpoint has idle room for, less the online peak."""
        runtime = self.cluster.endpoints.get(running.record.label)
        assert running.input is not None
        path = running.document["endpoint"]
        if runtime is None or runtime.spec.method_at(path.lstrip("/")) is None:
            running.ending = "failed"
            said = "its endpoint was stopped" if runtime is None else f"it no longer serves {path}"
            running.document["errors"] = {
                "object": "list",
                "data": [{"code": "endpoint_stopped", "message": said}],
            }
            return
        slots, free, online_waiting, batch_waiting, online = _load(runtime)
        peak = self._online.setdefault(runtime.label, OnlinePeak())
        peak.note(now, online)
        room = batch_room(slots, free, online_waiting, batch_waiting, peak.peak(now))
        requests = running.input.requests
        while room > 0 and running.record.next_line < len(requests):
            request = requests[running.record.next_line]
            try:
                self._submit(running, runtime, request.index, request.body, recovered=False)
            except (PlatformError, StoreWriteError) as refused:  # full: the next tick
                log.debug("batches: %s waits: %s", running.record.id, refused)
                return
            running.record.next_line += 1
            running.changed = True
            room -= 1

    def _submit(
        self,
        running: Running,
        runtime: EndpointRuntime,
        index: int,
        body: bytes,
        *,
        recovered: bool,
    ) -> None:
        path = running.document["endpoint"].lstrip("/")
        spec = runtime.spec.method_at(path)
        if spec is None:
            raise LookupError(f"{runtime.label} no longer serves {path}")
        prefix = None
        if runtime.settings.route_by == "prefix":
            text = prompt_text(json.loads(body))
            prefix = (block_hashes(text) or None) if text is not None else None
        call_id = request_call_id(running.record.id, index)
        inp = Input(
            id=call_id,
            label=runtime.label,
            method=spec.name,
            body=body,
            streaming=False,
            is_async=True,
            priority=BATCH_PRIORITY,
            prefix=prefix,
        )
        self.cluster.input_lifecycle.submit(inp, recovered=recovered)
        running.inflight.add(call_id)

    def _stop_queued(self, running: Running) -> None:
        """Its requests that wait in the queue end now; those running finish."""
        for call_id in list(running.inflight):
            inp = self.cluster.inputs.get(call_id)
            if inp is not None and inp.replica_id is None:
                message = CANCELLED if running.ending == "cancelled" else "the batch expired"
                self.cluster.input_lifecycle.stop(inp, Outcome.error(499, "cancelled", message))

    async def _finish(self, running: Running, now: float) -> None:
        """Its output and error files made from its requests' records, a line at a time,
        and its last status (completed, cancelled, expired or failed)."""
        document = running.document
        batch_id = running.record.id
        if running.ending != "failed":
            document["status"] = "finalizing"
            document["finalizing_at"] = int(now)
            self._write(running)
            for kind in ("output", "error"):
                made = await self.files.add_lines(
                    running.record.label,
                    "batch_output",
                    f"{batch_id}_{kind}.jsonl",
                    self._result_lines(running, errors=kind == "error"),
                )
                if batch_id not in self._running:  # its workspace was removed meanwhile
                    if made is not None:
                        self.files.blobs.delete(BLOB_PREFIX + made.id)
                    return
                if made is not None:
                    self.cluster.store.put_openai_file(made)
                document[f"{kind}_file_id"] = None if made is None else made.id
        status = running.ending or "completed"
        document["status"] = status
        document[f"{status}_at"] = int(time.time())
        self._write(running)
        del self._running[batch_id]

    async def _result_lines(self, running: Running, *, errors: bool) -> AsyncIterator[bytes]:
        """The output file's lines (answered 200), or the error file's (any other answer,
        a line that failed alone, a request left when the batch expired), one at a time:
        a batch's results are never all in memory at once."""
        assert running.input is not None
        batch_id = running.record.id
        if errors:
            for error in running.input.errors:
                line_id = f"batch_req_{batch_id}-line{error.line}"
                yield encoded(error_line(line_id, error.custom_id, error.code, error.message))
        for request in running.input.requests:
            if request.index % 64 == 0:
                await asyncio.sleep(0)  # reading records blocks: others' turn between
            call_id = request_call_id(batch_id, request.index)
            line_id = "batch_req_" + call_id.removeprefix(BATCH_CALL_PREFIX)
            submitted = request.index < running.record.next_line
            call = self.cluster.calls.get(call_id) if submitted else None
            if call is None or _never_ran(call):
                if errors and running.ending == "expired":
                    said = "the batch expired before this request ran"
                    yield encoded(error_line(line_id, request.custom_id, "batch_expired", said))
                continue  # cancelled before it ran: in neither file, as OpenAI does
            if (call.http_status == 200) != errors:
                yield encoded(answered_line(line_id, request.custom_id, call))

    def _write(self, running: Running) -> None:
        running.record.status = running.document["status"]
        running.record.document = json.dumps(running.document)
        try:
            self.cluster.store.put_batch(running.record)
            running.changed = False
        except StoreWriteError as error:  # kept in memory, written at a later tick
            log.warning("batches: %s not written: %s", running.record.id, error)
            running.changed = True


def _never_ran(call: CallRecord) -> bool:
    """Stopped before it ran (a cancel), or left unfinished by a control plane that
    stopped: in neither file."""
    return call.http_status == 499 or not call.status.finished


def _load(runtime: EndpointRuntime) -> tuple[int, int, int, int, int]:
    """(the ready replicas' slots, those free, online inputs waiting, batch inputs
    waiting, online inputs queued or running)."""
    slots = free = online_running = 0
    concurrency = runtime.settings.concurrency
    for replica in runtime.replicas.values():
        online_running += sum(1 for i in replica.inflight.values() if i.priority < BATCH_PRIORITY)
        if replica.state is ReplicaState.READY and replica.version == runtime.version:
            slots += concurrency
            free += max(0, concurrency - len(replica.inflight))
    batch_waiting = sum(1 for inp in runtime.pending if inp.priority >= BATCH_PRIORITY)
    online_waiting = len(runtime.pending) - batch_waiting
    return slots, free, online_waiting, batch_waiting, online_waiting + online_running
