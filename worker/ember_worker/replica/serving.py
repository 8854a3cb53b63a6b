"""The replica runtime: runs one endpoint's user code and serves inputs over its channel.

Order of a start: import the user's module, construct the class, run `enter(snap=True)`
hooks (the work a snapshot will hold), connect to the control plane, run the other
`enter()` hooks, report ready, serve up to `concurrency` inputs at once, and on SIGTERM
finish what is running, run `exit` hooks and leave.

`ReplicaRuntime` wires the parts: the channel (channel.py), the user's code and its hooks
(user_code.py), the inputs (inputs.py, with results.py and web_requests.py). The control
plane's messages are decoded and dispatched here, by their type; one that does not fit
its type is dropped with a line in the replica's log.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import assert_never

import msgspec
from websockets.asyncio.client import ClientConnection

from ember import cancellation
from ember.endpoints.decorators import EndpointDefinition
from ember.wire import messages as wire
from ember_worker.identity import ReplicaIdentity, ReplicaSpec
from ember_worker.replica.channel import ReplicaChannel
from ember_worker.replica.inputs import InputRunner
from ember_worker.replica.results import ResultSender
from ember_worker.replica.user_code import UserCode
from ember_worker.replica.web_requests import WebRequests

EXIT_LOST_CHANNEL = 1
EXIT_STARTUP_FAILED = 3
# How long a replica whose channel closed tries to open it again before it exits: long
# enough for another control-plane process to take over (a lease of 2 s) and for its
# worker to say hello there.
REOPEN_SECONDS = 12.0


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

    def run_snap_hooks(self) -> None:
        """Before any connection exists: the state a snapshot captures (UserCode)."""
        self.code.run_snap_hooks()

    async def serve(self, identity: ReplicaIdentity, report: wire.StartReport) -> int:
        async with self.channel.open(identity) as ws:
            began = time.monotonic()
            try:
                await self.code.enter()
            except Exception as exc:
                traceback.print_exc()
                failed = wire.StartupFailed(error_type=type(exc).__name__, message=str(exc))
                await ws.send(wire.frame(failed))
                return EXIT_STARTUP_FAILED
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.draining.set)
            entered = msgspec.structs.replace(report, enter_seconds=time.monotonic() - began)
            await ws.send(wire.frame(wire.Ready(start=entered)))
            health = self.code.start_health_checks(self._report_unhealthy)
            engine = self._scrape_engine_metrics()
            try:
                code = await self._serve_channels(ws, identity)
            finally:
                for task in (health, engine):
                    if task is not None:
                        task.cancel()
            if code is not None:
                return code
            # Draining: finish the inputs in flight, then run exit hooks.
            if self.inputs.tasks:
                await asyncio.wait(list(self.inputs.tasks.values()))
            await self.code.exit()
            return 0

    async def _serve_channels(self, ws: ClientConnection, identity: ReplicaIdentity) -> int | None:
        """Inputs from the channel until draining (None), through a channel opened again
        each time it closes; EXIT_LOST_CHANNEL once it cannot be opened again within
        REOPEN_SECONDS. Inputs running when it closed are cancelled (one in a thread
        finishes); what they send is dropped, or taken by a control plane that knows them."""
        first = ws
        try:
            while True:
                heartbeat = asyncio.ensure_future(self.channel.heartbeat(ws))
                reader = asyncio.ensure_future(self.channel.read(ws, self._dispatch))
                drained = asyncio.ensure_future(self.draining.wait())
                await asyncio.wait({reader, drained}, return_when=asyncio.FIRST_COMPLETED)
                heartbeat.cancel()
                drained.cancel()
                if not reader.done():
                    reader.cancel()
                    return None
                if self.draining.is_set():
                    return None  # asked to stop: it finishes what it runs, then exits
                print("ember: lost the control plane's channel; opening it again", file=sys.stderr)
                # What it runs has nobody to answer to: the callers' connections went with
                # that control plane, and the next one runs spawned calls again from the
                # store. Cancelled, so that a stream does not run on unread for minutes.
                for input_id in list(self.inputs.tasks):
                    self.inputs.cancel(input_id)
                if ws is not first:
                    await ws.close()
                reopened = await self.channel.reopen(identity, REOPEN_SECONDS, self.draining)
                if reopened is not None and self.draining.is_set():
                    await reopened.close()  # asked to stop meanwhile: it takes nothing new
                    return None
                if reopened is None:
                    if self.draining.is_set():
                        return None
                    print("ember: lost the control plane's channel; exiting", file=sys.stderr)
                    return EXIT_LOST_CHANNEL
                ws = reopened
                print("ember: the control plane's channel is open again", file=sys.stderr)
                adopted = wire.StartReport(kind=wire.ADOPTED)
                await ws.send(wire.frame(wire.Ready(start=adopted)))
        finally:
            if ws is not first:
                await ws.close()

    def _scrape_engine_metrics(self) -> asyncio.Future[None] | None:
        """The engine's metrics, scraped from now on if the endpoint names them."""
        source = self.code.definition.settings.engine_metrics
        if source is None:
            return None
        # Here: the scraper's HTTP client is for the endpoints that name a source.
        from ember_worker.replica.engine_scrape import EngineScraper

        return asyncio.ensure_future(EngineScraper(source, self.channel.send).run())

    async def _report_unhealthy(self, check: str, reason: str) -> None:
        await self.channel.send(wire.Unhealthy(check=check, reason=reason))

    def _dispatch(self, message: str) -> None:
        """One message from the control plane: its header, then its body."""
        try:
            header, body = wire.to_replica(message)
        except wire.WireError as error:  # never the end of the channel's reading
            print(f"ember: dropped a message from the control plane: {error}", file=sys.stderr)
            return
        match header:
            case wire.Input():
                flag = cancellation.InputFlag(
                    header.id, header.affinity, header.trace, header.priority
                )
                self.inputs.start(flag, header.method, body, header.stream, header.echo)
            case wire.InputMessage():  # for a WebSocket session: its caller's message
                self.web.inbox(header.id).put_nowait(body)
            case wire.Ack():  # the control plane took this much of a stream
                self.channel.acknowledged(header.id, header.bytes)
            case wire.Cancel():
                self.inputs.cancel(header.id)
            case _:
                assert_never(header)

    def _input_ended(self, input_id: str) -> None:
        self.web.forget(input_id)
        self.channel.forget(input_id)
