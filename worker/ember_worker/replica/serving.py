"""The replica runtime: runs one endpoint's user code and serves inputs over its channel.

Order of a start: import the user's module, construct the class, run `enter(snap=True)`
hooks (the work a snapshot will hold), connect to the control plane, run the other
`enter()` hooks, report ready, serve up to `concurrency` inputs at once, and on SIGTERM
finish what is running, run `exit` hooks and leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ember import cancellation, user_metrics
from ember.endpoints.argcheck import ArgumentTypeError, check_arguments, parameter_hints
from ember.endpoints.asgi import (
    RESPONSE_CHUNK_BYTES,
    HttpRequest,
    decode_websocket_message,
    encode_websocket_message,
    is_wsgi_factory,
    response_body_events,
    response_start_event,
    whole_response,
)
from ember.endpoints.batching import BatchSettings, batch_settings
from ember.endpoints.decorators import EndpointDefinition, stream_flag
from ember.endpoints.parameters import decode_nested_bytes, encode_bytes, holds_bytes
from ember.endpoints.structured import convert, has_structured, to_json
from ember.errors import InputError
from ember.files import File, as_file, result_header
from ember.wire.limits import MAX_FILE_RESULT_BYTES, MAX_RESULT_BYTES, MIB
from ember.wire.spec import FUNCTION_METHOD
from ember_worker.channel_url import open_channel
from ember_worker.identity import ReplicaIdentity, ReplicaSpec
from ember_worker.replica.asgi_lifespan import AppLifespan
from ember_worker.replica.batching import Batcher
from ember_worker.replica.health_checks import HealthMonitor
from ember_worker.replica.stream_windows import StreamWindow
from ember_worker.replica.wsgi_bridge import WsgiBridge

# Separates messages batched into one frame (see ember_platform.core.cluster_model).
RECORD_SEPARATOR = "\x1e"
HEARTBEAT_SECONDS = 1.0
_DONE = object()


def _iterator_for_plain_call(func: Callable[..., Any]) -> str:
    flag = stream_flag(func)
    return (
        f"{getattr(func, '__qualname__', 'the method')} returned an iterator for a call that "
        f"did not ask to stream ({flag} was not true)"
    )


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


class InvalidArguments(Exception):
    """The caller's keyword arguments do not fit the method's signature."""


class ResultTooLargeError(Exception):
    """A result or stream event over what one channel message may carry."""


def frame(header: dict[str, Any], body: str = "") -> str:
    return json.dumps(header) + "\n" + body


async def call_hook(func: Callable[[], Any]) -> None:
    """Run a lifecycle hook: awaited if async, in a thread if sync (heartbeats go on)."""
    if inspect.iscoroutinefunction(func):
        await func()
    else:
        await asyncio.to_thread(func)


def make_web_app(factory: Callable[[], Any], executor: Executor) -> Any:
    """Call a web-app endpoint's `@ember.asgi_app()` (or `wsgi_app()`) function; its app
    must be callable. A WSGI app is served through a bridge, in threads of `executor`."""
    app = factory()
    if inspect.isawaitable(app):
        app = asyncio.run(_awaited(app))
    wsgi = is_wsgi_factory(factory)
    if not callable(app):
        name = getattr(factory, "__qualname__", "the web app's function")
        kind = "a WSGI" if wsgi else "an ASGI"
        raise TypeError(f"{name} returned {type(app).__name__}, not {kind} app")
    return WsgiBridge(app, executor) if wsgi else app


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def drop_weights_connections() -> None:
    """Close the connections of weights readers, if any were opened: before the quiet
    point, and after a restore (whatever the image held is dead)."""
    opener = sys.modules.get("ember_worker.weights.opener")
    if opener is not None:
        opener.drop_connections()


def follow_weights_cache_dir() -> None:
    """After a restore: weights readers opened before the snapshot write into this
    node's cache, not the snapshot node's (opener.follow_cache_dir)."""
    opener = sys.modules.get("ember_worker.weights.opener")
    if opener is not None:
        opener.follow_cache_dir()


def complete_mapped_weights() -> None:
    """Make whole on this node's disk every weights object a tensor still maps, if
    weights were opened at all (opener.complete_mapped_objects)."""
    opener = sys.modules.get("ember_worker.weights.opener")
    if opener is not None:
        opener.complete_mapped_objects()


def weights_read() -> list[dict[str, str | None]]:
    """The weights objects this process has read and their versions (versions.py), for
    the image's metadata."""
    module = sys.modules.get("ember_worker.weights.versions")
    return module.as_dicts(module.read_objects()) if module is not None else []


def check_weights_versions(timeout: float) -> dict[str, Any] | None:
    """After a restore: whether the weights read before the snapshot are still current
    at their origins (a `weights_checked` event for the agent); None if none were read."""
    module = sys.modules.get("ember_worker.weights.versions")
    objects = module.read_objects() if module is not None else []
    if module is None or not objects:
        return None
    started = time.monotonic()
    freshness = module.check(objects, timeout)
    return dict(freshness.to_event(time.monotonic() - started, len(objects)))


def weights_read_totals() -> dict[str, Any] | None:
    """{"weights": running totals} once this process has read weights, else None."""
    module = sys.modules.get("ember_worker.weights.totals")
    if module is None:
        return None
    counts = module.totals.snapshot()
    return {"weights": counts} if counts["chunks"] else None


def reset_weights_totals() -> None:
    """After a restore: the reads in the image were the original replica's, counted there."""
    module = sys.modules.get("ember_worker.weights.totals")
    if module is not None:
        module.totals.reset()


class ReplicaRuntime:
    def __init__(self, spec: ReplicaSpec, definition: EndpointDefinition) -> None:
        self.spec = spec
        self.definition = definition
        self.instance: Any = definition.target() if definition.kind == "class" else None
        settings = definition.settings
        if self.instance is not None and settings.weights:
            from ember_worker.weights.opener import WeightsByName

            # Opened on first use, so an endpoint that never reads them pays nothing.
            self.instance.weights = WeightsByName(settings.weights, settings.s3_endpoint_url)
        self.executor = ThreadPoolExecutor(
            max_workers=spec.concurrency, thread_name_prefix="ember-input"
        )
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._sending: set[asyncio.Future[None]] = set()  # held: the loop keeps tasks weakly
        self.draining = asyncio.Event()
        self.ws: ClientConnection | None = None
        # Per function: its signature, parameter hints, defaults, parameters that hold
        # bytes (with their hints) and
        # structured ones (Pydantic models, dataclasses), read once.
        self._signatures: dict[
            Callable[..., Any],
            tuple[
                inspect.Signature, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]
            ],
        ] = {}
        self._batchers: dict[str, Batcher] = {}
        # Per streaming input: whether its items are bytes (a file) or JSON values.
        self._stream_is_file: dict[str, bool] = {}
        self.web_app: Any = None  # a web-app endpoint's ASGI app, made by run_snap_hooks
        self.lifespan: AppLifespan | None = None  # its lifespan, started once it may serve
        self.inboxes: dict[str, asyncio.Queue[str]] = {}  # WebSocket sessions' messages
        self.windows: dict[str, StreamWindow] = {}  # streaming inputs' flow control

    def hooks(self, *, snap: bool) -> list[Callable[[], Any]]:
        return [
            getattr(self.instance, name)
            for name, is_snap in self.definition.enter_hooks
            if is_snap == snap
        ]

    def run_snap_hooks(self) -> None:
        """Before any connection exists: this is the state a snapshot captures. Weights
        kept as views of the node cache's files stay mappings: a snapshot leaves their
        pages out and a restore maps the same files again, so each is made whole here."""
        if self.definition.kind == "asgi":
            self.web_app = make_web_app(self.definition.target, self.executor)
        for hook in self.hooks(snap=True):
            if inspect.iscoroutinefunction(hook):
                asyncio.run(hook())
            else:
                hook()
        weights: Any = getattr(self.instance, "weights", None)
        if self.definition.settings.snapshot:
            if hasattr(weights, "prepare"):
                # Into the image: a restored replica's first weights read skips this set-up.
                weights.prepare()
            complete_mapped_weights()
        drop_weights_connections()  # a snapshot cannot hold open connections

    def target(self, method: str) -> Callable[..., Any]:
        if method == FUNCTION_METHOD:
            return self.definition.target
        return getattr(self.instance, method)

    async def serve(self, identity: ReplicaIdentity, report: StartReport) -> int:
        async with open_channel(
            identity.server_url,
            f"/v1/replicas/{identity.replica_id}/channel",
            channel_socket=identity.channel_socket,
            ca_cert=identity.ca_cert,
            additional_headers={"Authorization": f"Bearer {identity.token}"},
            max_size=None,
            ping_interval=None,
            compression=None,
        ) as ws:
            self.ws = ws
            began = time.monotonic()
            try:
                if self.web_app is not None and not isinstance(self.web_app, WsgiBridge):
                    self.lifespan = AppLifespan(self.web_app)
                    await self.lifespan.startup()
                for hook in self.hooks(snap=False):
                    await call_hook(hook)
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
                return 3
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self.draining.set)
            start = {**asdict(report), "enter_seconds": time.monotonic() - began}
            await ws.send(frame({"type": "ready", "start": start}))
            heartbeat = asyncio.ensure_future(self._heartbeat(ws))
            health = self._start_health_checks()
            reader = asyncio.ensure_future(self._read(ws))
            drained = asyncio.ensure_future(self.draining.wait())
            await asyncio.wait({reader, drained}, return_when=asyncio.FIRST_COMPLETED)
            if health is not None:
                health.cancel()
            if reader.done():
                heartbeat.cancel()
                drained.cancel()
                print("ember: lost the control plane's channel; exiting", file=sys.stderr)
                return 1
            # Draining: finish the inputs in flight, then run exit hooks.
            if self.tasks:
                await asyncio.wait(list(self.tasks.values()))
            await self._run_exit_hooks()
            heartbeat.cancel()
            reader.cancel()
            return 0

    def _start_health_checks(self) -> asyncio.Task[None] | None:
        """The class's `@ember.health_check`, run from now on (after any snapshot)."""
        if self.definition.health_check is None:
            return None
        name, check = self.definition.health_check

        async def report_unhealthy(reason: str) -> None:
            await self._send({"type": "unhealthy", "check": name, "reason": reason})

        monitor = HealthMonitor(name, getattr(self.instance, name), check, report_unhealthy)
        return asyncio.ensure_future(monitor.run())

    async def _run_exit_hooks(self) -> None:
        if self.lifespan is not None:
            try:
                await self.lifespan.shutdown()
            except Exception:
                traceback.print_exc()
        for name in self.definition.exit_hooks:
            try:
                await call_hook(getattr(self.instance, name))
            except Exception:
                traceback.print_exc()

    async def _heartbeat(self, ws: ClientConnection) -> None:
        plain = frame({"type": "heartbeat"})
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            weights = weights_read_totals()
            metrics = user_metrics.snapshot()  # the code's own: ember.Counter, Gauge, Histogram
            if weights is None and not metrics:
                await ws.send(plain)
                continue
            header: dict[str, Any] = {"type": "heartbeat", **(weights or {})}
            if metrics:
                header["metrics"] = metrics
            await ws.send(frame(header))

    async def _read(self, ws: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame_text in ws:
                text = frame_text if isinstance(frame_text, str) else frame_text.decode()
                for message in text.split(RECORD_SEPARATOR):
                    self._dispatch(message)

    def _dispatch(self, message: str) -> None:
        header_text, _, body = message.partition("\n")
        header = json.loads(header_text)
        if header["type"] == "input":
            input_id = header["id"]
            stream = bool(header.get("stream"))
            flag = cancellation.InputFlag(input_id, header.get("affinity"), header.get("trace"))
            task = asyncio.ensure_future(self._run_input(flag, header["method"], body, stream))
            self.tasks[input_id] = task
            task.add_done_callback(lambda done: self._input_done(input_id, done))
        elif header["type"] == "message":  # for a WebSocket session: its caller's message
            self._inbox(header["id"]).put_nowait(body)
        elif header["type"] == "ack":  # the control plane took this much of a stream
            window = self.windows.get(header["id"])
            if window is not None:
                window.acknowledged(int(header["bytes"]))
        elif header["type"] == "cancel":
            running = self.tasks.get(header["id"])
            # Once only: a second cancel would cut short its wait for the input's thread.
            if running is not None and not running.cancelling():
                running.cancel()

    def _inbox(self, input_id: str) -> asyncio.Queue[str]:
        inbox = self.inboxes.get(input_id)
        if inbox is None:
            inbox = self.inboxes[input_id] = asyncio.Queue()
        return inbox

    def _input_done(self, input_id: str, task: asyncio.Task[None]) -> None:
        self.tasks.pop(input_id, None)
        self.inboxes.pop(input_id, None)
        self.windows.pop(input_id, None)
        if task.cancelled():
            # Cancelled before its first step (its input and cancel came in one read), so
            # its own handler never ran to say so; unsaid, the platform holds the slot
            # until the endpoint's timeout.
            print(f"ember: input {input_id} cancelled before it started", file=sys.stderr)
            said = asyncio.ensure_future(self._send({"type": "cancelled", "id": input_id}))
            self._sending.add(said)
            said.add_done_callback(self._sending.discard)

    def _bind(self, func: Callable[..., Any], body: str) -> dict[str, Any]:
        kwargs = json.loads(body) if body else {}
        known = self._signatures.get(func)
        if known is None:
            signature = inspect.signature(func)
            # A batched method's hints describe lists of what each caller sends: not checked.
            hints = parameter_hints(func) if batch_settings(func) is None else {}
            defaults = {
                name: p.default
                for name, p in signature.parameters.items()
                if p.default is not inspect.Parameter.empty
            }
            binary = {name: hint for name, hint in hints.items() if holds_bytes(hint)}
            # Pydantic models and dataclasses to build from their JSON objects.
            built = {name: hint for name, hint in hints.items() if has_structured(hint)}
            known = self._signatures[func] = (signature, hints, defaults, binary, built)
        signature, hints, defaults, binary, built = known
        name = getattr(func, "__name__", "endpoint")
        try:
            for parameter, hint in binary.items():  # base64 in JSON: see ember.endpoints.parameters
                if parameter in kwargs:
                    kwargs[parameter] = decode_nested_bytes(hint, kwargs[parameter], parameter)
            signature.bind(**kwargs)
            check_arguments(hints, defaults, kwargs)
            for parameter, hint in built.items():
                if parameter not in kwargs:
                    continue
                value = kwargs[parameter]
                if value is None and parameter in defaults and defaults[parameter] is None:
                    continue  # `p: Point = None` called with null, as check_arguments lets
                kwargs[parameter] = convert(value, hint, parameter)
        except (TypeError, ArgumentTypeError) as exc:
            raise InvalidArguments(f"{name}(): {exc}") from None
        return kwargs

    async def _send(self, header: dict[str, Any], body: str = "") -> None:
        if self.ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await self.ws.send(frame(header, body))
        if header["type"] == "event":
            window = self.windows.get(header["id"])
            if window is None:
                window = self.windows[header["id"]] = StreamWindow()
            await window.after_send(len(body))

    async def _run_input(
        self, gone: cancellation.InputFlag, method: str, body: str, stream: bool
    ) -> None:
        """Run one input. `gone` is what `ember.cancelled()` (and `current_affinity_key()`)
        read in the input's code; calls it makes name the input as their parent."""
        input_id = gone.input_id
        work: asyncio.Future[Any] | None = None  # a sync call's thread, which cannot be stopped
        cancellation.bind_task(gone)  # this task is the input's own: async code sees it
        try:
            if self.web_app is not None:
                await self._serve_web_request(input_id, body)
                return
            func = self.target(method)
            kwargs = self._bind(func, body)
            batching = batch_settings(func)
            if stream_flag(func) is not None:
                # The call's flag chose: the method returns an iterator or a JSON value.
                if inspect.iscoroutinefunction(func):
                    result = await func(**kwargs)
                else:
                    loop = asyncio.get_running_loop()
                    call = cancellation.bound(gone, lambda: func(**kwargs))
                    work = loop.run_in_executor(self.executor, call)
                    result = await asyncio.shield(work)
                await self._answer_flagged(input_id, func, result, stream, gone)
            elif batching is not None:
                result = await self._batcher(method, func, batching).submit(kwargs)
                await self._send_result(input_id, func, result)
            elif inspect.isasyncgenfunction(func):
                async for item in func(**kwargs):
                    await self._send_event(input_id, func, item)
                await self._send({"type": "end", "id": input_id})
            elif inspect.isgeneratorfunction(func):
                loop = asyncio.get_running_loop()
                generator = await loop.run_in_executor(self.executor, lambda: func(**kwargs))
                await self._stream_sync(input_id, func, generator, gone)
            elif inspect.iscoroutinefunction(func):
                result = await func(**kwargs)
                await self._send_result(input_id, func, result)
            else:
                loop = asyncio.get_running_loop()
                work = loop.run_in_executor(
                    self.executor, cancellation.bound(gone, lambda: func(**kwargs))
                )
                result = await asyncio.shield(work)
                await self._send_result(input_id, func, result)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                # Raised by the code itself (it awaited a task that was cancelled), not a
                # cancel of the platform's: the input failed, and its caller must hear so.
                traceback.print_exc()
                await self._send_error(input_id, exc)
                return
            # The caller left. The slot is free only once the work has really stopped; code
            # that asks `ember.cancelled()` stops early.
            gone.set()
            if work is not None and not work.done():
                print(f"ember: input {input_id} cancelled; waiting for its thread", file=sys.stderr)
                await asyncio.wait({work})
            if work is not None and not work.cancelled():
                # What it raised on its way out (often that its own calls were cancelled)
                # is no news: taken here, asyncio does not print it as never retrieved.
                work.exception()
            print(f"ember: input {input_id} cancelled", file=sys.stderr)
            await self._send({"type": "cancelled", "id": input_id})
        except ResultTooLargeError as exc:
            print(f"ember: input {input_id}: {exc}", file=sys.stderr)
            await self._send(
                {
                    "type": "error",
                    "id": input_id,
                    "status": 500,
                    "error_type": "result_too_large",
                    "message": str(exc),
                }
            )
        except (InvalidArguments, InputError) as exc:
            await self._send(
                {
                    "type": "error",
                    "id": input_id,
                    "status": 400,
                    "error_type": (
                        "invalid_input" if isinstance(exc, InputError) else "invalid_arguments"
                    ),
                    "message": str(exc),
                }
            )
        except (SystemExit, KeyboardInterrupt):
            raise  # the code asked for its process to end: the replica does (502 for it)
        except BaseException as exc:  # an Exception, or a BaseException of the code's own
            traceback.print_exc()
            await self._send_error(input_id, exc)
        finally:
            self._stream_is_file.pop(input_id, None)

    async def _send_error(self, input_id: str, exc: BaseException) -> None:
        """The input failed in its code: 500 with the exception's type and message."""
        await self._send(
            {
                "type": "error",
                "id": input_id,
                "status": 500,
                "error_type": type(exc).__name__,
                "message": str(exc) or repr(exc),
            }
        )

    async def _serve_web_request(self, input_id: str, body: str) -> None:
        """Run the web app on one request; its response goes out as it is sent."""
        request = HttpRequest.decode(body)
        if request.kind == "websocket":
            await self._serve_websocket(input_id, request)
            return
        delivered = False
        start: dict[str, Any] | None = None  # the app's response start, held back
        streaming = answered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            # The one body message was given; the next is the caller leaving, which
            # cancels this task instead (no work left running for nobody).
            await asyncio.Future()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal start, streaming, answered
            if message["type"] == "http.response.start" and start is None:
                start = message
            elif message["type"] == "http.response.body" and start is not None and not answered:
                body = message.get("body", b"")
                last = not message.get("more_body", False)
                if not streaming and last and len(body) <= RESPONSE_CHUNK_BYTES:
                    # The whole response in one message (most answers): one frame.
                    answered = True
                    whole = whole_response(start["status"], start.get("headers", []), body)
                    await self._send({"type": "result", "id": input_id}, whole)
                    return
                if not streaming:
                    streaming = True
                    event = response_start_event(start["status"], start.get("headers", []))
                    await self._send({"type": "event", "id": input_id}, event)
                for event in response_body_events(body):
                    await self._send({"type": "event", "id": input_id}, event)

        await self.web_app(self._app_scope(request), receive, send)
        if start is None:
            raise RuntimeError("the web app returned without sending a response")
        if not answered:
            if not streaming:  # a start and no body message: an empty body
                whole = whole_response(start["status"], start.get("headers", []), b"")
                await self._send({"type": "result", "id": input_id}, whole)
                return
            await self._send({"type": "end", "id": input_id})

    async def _serve_websocket(self, input_id: str, request: HttpRequest) -> None:
        """Run the web app on one WebSocket session: `websocket.connect`, then the caller's
        messages as they come; what the app sends goes out as stream events."""
        inbox = self._inbox(input_id)
        connected = False

        async def receive() -> dict[str, Any]:
            nonlocal connected
            if not connected:
                connected = True
                return {"type": "websocket.connect"}
            return decode_websocket_message(await inbox.get())

        async def send(message: dict[str, Any]) -> None:
            text = encode_websocket_message(message)
            if len(text) > MAX_RESULT_BYTES:
                raise ResultTooLargeError(
                    f"a WebSocket message of {len(text) / MIB:.1f} MiB (in base64 for bytes) is "
                    f"over the limit of {MAX_RESULT_BYTES // MIB} MiB for one message"
                )
            await self._send({"type": "event", "id": input_id}, text)

        await self.web_app(self._app_scope(request), receive, send)
        await self._send({"type": "end", "id": input_id})

    def _app_scope(self, request: HttpRequest) -> dict[str, Any]:
        """The request's scope, with a copy of the state the app's lifespan set."""
        scope = request.scope()
        if self.lifespan is not None:
            scope["state"] = dict(self.lifespan.state)
        return scope

    def _batcher(self, method: str, func: Callable[..., Any], settings: BatchSettings) -> Batcher:
        """One batcher per method for the replica's life: its inputs meet there."""
        batcher = self._batchers.get(method)
        if batcher is None:
            batcher = self._batchers[method] = Batcher(func, settings, self.executor)
        return batcher

    async def _send_result(self, input_id: str, func: Callable[..., Any], result: Any) -> None:
        """A call's one answer: a JSON value, or a file (`ember.File`, bytes) that the
        control plane answers with as it is."""
        await self._send_value("result", input_id, func, result)

    async def _send_value(
        self, kind: str, input_id: str, func: Callable[..., Any], value: Any
    ) -> None:
        file = as_file(value)
        if file is None:
            await self._send({"type": kind, "id": input_id}, self._encode(func, value))
            return
        self._check_file_size(func, file)
        header = {"type": kind, "id": input_id, **result_header(file)}
        await self._send(header, encode_bytes(file.data))

    async def _send_event(self, input_id: str, func: Callable[..., Any], item: Any) -> None:
        """One item of a stream: a JSON value (a server-sent event), or bytes (a chunk of
        a stream that is a file: see `ember.files`)."""
        file = as_file(item)
        is_file = self._stream_is_file.setdefault(input_id, file is not None)
        if is_file != (file is not None):
            raise TypeError(
                f"{getattr(func, '__qualname__', 'the endpoint')} yielded "
                f"{'bytes after JSON values' if file else 'a JSON value after bytes'}: a "
                "stream is all bytes (a file) or all JSON values (events)"
            )
        await self._send_value("event", input_id, func, item)

    @staticmethod
    def _check_file_size(func: Callable[..., Any], file: File) -> None:
        if len(file.data) > MAX_FILE_RESULT_BYTES:  # its base64 must fit a message
            raise ResultTooLargeError(
                f"{getattr(func, '__qualname__', 'the endpoint')} returned a file of "
                f"{len(file.data) / MIB:.1f} MiB, over the limit of "
                f"{MAX_FILE_RESULT_BYTES // MIB} MiB: yield it in smaller chunks from a "
                "generator"
            )

    async def _answer_flagged(
        self,
        input_id: str,
        func: Callable[..., Any],
        result: Any,
        stream: bool,
        gone: threading.Event,
    ) -> None:
        """Send what a method with a stream flag returned, as the call asked."""
        if hasattr(result, "__aiter__"):
            if not stream:
                if hasattr(result, "aclose"):
                    await result.aclose()
                raise TypeError(_iterator_for_plain_call(func))
            async for item in result:
                await self._send_event(input_id, func, item)
            await self._send({"type": "end", "id": input_id})
        elif isinstance(result, Iterator):
            if not stream:
                loop = asyncio.get_running_loop()
                if hasattr(result, "close"):
                    await loop.run_in_executor(self.executor, result.close)
                raise TypeError(_iterator_for_plain_call(func))
            await self._stream_sync(input_id, func, result, gone)
        elif stream:  # one value for a streaming call: a stream of one event
            await self._send_event(input_id, func, result)
            await self._send({"type": "end", "id": input_id})
        else:
            await self._send_result(input_id, func, result)

    async def _stream_sync(
        self,
        input_id: str,
        func: Callable[..., Any],
        generator: Iterator[Any],
        gone: threading.Event,
    ) -> None:
        loop = asyncio.get_running_loop()
        pending: asyncio.Future[Any] | None = None
        step = cancellation.bound(gone, next)
        try:
            while True:
                pending = loop.run_in_executor(self.executor, step, generator, _DONE)
                item = await asyncio.shield(pending)
                if item is _DONE:
                    break
                await self._send_event(input_id, func, item)
            await self._send({"type": "end", "id": input_id})
        except asyncio.CancelledError:
            gone.set()  # the item being made may ask `ember.cancelled()` and stop early
            raise
        finally:
            # Runs on cancel too (the caller left): let the item being made finish, then
            # close the generator so that its finally blocks run now.
            if pending is not None and not pending.done():
                await asyncio.wait({pending})
            close = getattr(generator, "close", None)
            if close is not None:
                await loop.run_in_executor(self.executor, close)

    @staticmethod
    def _encode(func: Callable[..., Any], value: Any) -> str:
        name = getattr(func, "__qualname__", "the endpoint")
        try:
            # ASCII: as many bytes as characters; models and dataclasses as their JSON.
            # allow_nan=False: NaN and Infinity are not JSON; clients other than Python's
            # (browsers, Go, Rust) could not read the answer.
            text = json.dumps(value, default=to_json, allow_nan=False)
        except ValueError as exc:
            if "Out of range float" not in str(exc):
                raise TypeError(f"{name} returned a value that is not JSON: {exc}") from None
            raise TypeError(
                f"{name} returned NaN or Infinity, which JSON cannot hold: return None or a "
                "string for such a number"
            ) from None
        except TypeError as exc:
            raise TypeError(
                f"{name} returned a value that is not JSON-serializable: {exc}"
            ) from None
        if len(text) > MAX_RESULT_BYTES:
            raise ResultTooLargeError(
                f"{name} returned {len(text) / MIB:.1f} MiB of JSON, over the limit of "
                f"{MAX_RESULT_BYTES // MIB} MiB for one result or stream event: stream it "
                "in smaller events, or store it and return where it is"
            )
        return text
