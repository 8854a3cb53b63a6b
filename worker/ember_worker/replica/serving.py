"""The replica runtime: runs one endpoint's user code and serves inputs over its channel.

Order of a start: import the user's module, construct the class, run `enter(snap=True)`
hooks (the work a snapshot will hold), connect to the control plane, run the other
`enter()` hooks, report ready, serve up to `concurrency` inputs at once, and on SIGTERM
finish what is running, run `exit` hooks and leave.

`ReplicaRuntime` wires the parts: the channel (channel.py), the user's code and its hooks
(user_code.py), the inputs (inputs.py, with results.py and web_requests.py). The control
plane's messages are dispatched here, in one table.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ember import cancellation
from ember.endpoints.decorators import EndpointDefinition
from ember_worker.identity import ReplicaIdentity, ReplicaSpec
from ember_worker.replica.channel import ReplicaChannel, frame
from ember_worker.replica.inputs import InputRunner
from ember_worker.replica.results import ResultSender
from ember_worker.replica.user_code import UserCode
from ember_worker.replica.web_requests import WebRequests

EXIT_LOST_CHANNEL = 1
EXIT_STARTUP_FAILED = 3


@dataclass(frozen=True)
class StartReport:
    """How this replica started, sent with `ready`: shown by `ember ls` and the logs."""

    kind: str  # "cold" or "restore"
    boot_seconds: float  # imports and enter(snap=True) hooks, in this process
    fetch_seconds: float  # fetching the snapshot image (agent side)
    restore_seconds: float  # CRIU restoring the process (agent side)
    memory_pending: bool = False  # a lazy restore whose memory is still arriving
    # A restore asking the weights' origins whether they changed (None: nothing to ask).
    weights_check_seconds: float | None = None


class ReplicaRuntime:
    def __init__(
        self,
        spec: ReplicaSpec,
        definition: EndpointDefinition,
        channel: ReplicaChannel | None = None,
    ) -> None:
        self.spec = spec
        self.executor = ThreadPoolExecutor(
            max_workers=spec.concurrency, thread_name_prefix="ember-input"
        )
        self.code = UserCode(definition, self.executor)
        self.channel = channel if channel is not None else ReplicaChannel()
        self.draining = asyncio.Event()
        self.web = WebRequests(self.code, self.channel.send)
        self.inputs = InputRunner(
            self.code,
            self.executor,
            results=ResultSender(self.channel.send),
            web=self.web,
            send=self.channel.send,
            ended=self._input_ended,
        )
        # The control plane's messages, by type: what each does here.
        self.messages: dict[str, Callable[[dict[str, Any], str], None]] = {
            "input": self._input,
            "message": self._message,
            "ack": self._ack,
            "cancel": self._cancel,
        }

    def run_snap_hooks(self) -> None:
        """Before any connection exists: the state a snapshot captures (UserCode)."""
        self.code.run_snap_hooks()

    async def serve(self, identity: ReplicaIdentity, report: StartReport) -> int:
        async with self.channel.open(identity) as ws:
            began = time.monotonic()
            try:
                await self.code.enter()
            except Exception as exc:
                traceback.print_exc()
                await ws.send(
                    frame(
                        {
                            "type": "startup_failed",
                            "error_type": type(exc).__name__,
                            "message": str(exc),
                        }
                    )
                )
                return EXIT_STARTUP_FAILED
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.draining.set)
            start = {**asdict(report), "enter_seconds": time.monotonic() - began}
            await ws.send(frame({"type": "ready", "start": start}))
            heartbeat = asyncio.ensure_future(self.channel.heartbeat(ws))
            health = self.code.start_health_checks(self._report_unhealthy)
            reader = asyncio.ensure_future(self.channel.read(ws, self._dispatch))
            drained = asyncio.ensure_future(self.draining.wait())
            await asyncio.wait({reader, drained}, return_when=asyncio.FIRST_COMPLETED)
            if health is not None:
                health.cancel()
            if reader.done():
                heartbeat.cancel()
                drained.cancel()
                print("ember: lost the control plane's channel; exiting", file=sys.stderr)
                return EXIT_LOST_CHANNEL
            # Draining: finish the inputs in flight, then run exit hooks.
            if self.inputs.tasks:
                await asyncio.wait(list(self.inputs.tasks.values()))
            await self.code.exit()
            heartbeat.cancel()
            reader.cancel()
            return 0

    async def _report_unhealthy(self, check: str, reason: str) -> None:
        await self.channel.send({"type": "unhealthy", "check": check, "reason": reason})

    def _dispatch(self, message: str) -> None:
        """One message from the control plane: a JSON header line, then its body."""
        header_text, _, body = message.partition("\n")
        header = json.loads(header_text)
        handler = self.messages.get(header["type"])
        if handler is not None:
            handler(header, body)

    def _input(self, header: dict[str, Any], body: str) -> None:
        stream = bool(header.get("stream"))
        flag = cancellation.InputFlag(header["id"], header.get("affinity"), header.get("trace"))
        self.inputs.start(flag, header["method"], body, stream)

    def _message(self, header: dict[str, Any], body: str) -> None:
        """For a WebSocket session: its caller's message."""
        self.web.inbox(header["id"]).put_nowait(body)

    def _ack(self, header: dict[str, Any], body: str) -> None:
        """The control plane took this much of a stream."""
        self.channel.acknowledged(header["id"], int(header["bytes"]))

    def _cancel(self, header: dict[str, Any], body: str) -> None:
        self.inputs.cancel(header["id"])

    def _input_ended(self, input_id: str) -> None:
        self.web.forget(input_id)
        self.channel.forget(input_id)
