"""The inputs the control plane sends, each run as its own task: its JSON arguments
bound to the method's signature, then the code called as it is made (a function, a
generator, async or not, or a batch shared with other inputs) and what it returns or
yields sent back (results.py). A cancel stops the task; a sync call's thread cannot be
stopped, so the slot is free once the code has returned (`ember.cancelled()` says when
it may stop early), and every input ends with one message to say how."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from ember import cancellation
from ember.declarations.argcheck import ArgumentTypeError, check_arguments, parameter_hints
from ember.declarations.parameters import decode_nested_bytes, holds_bytes
from ember.declarations.structured import convert, has_structured
from ember.endpoints.batching import BatchSettings, batch_settings
from ember.endpoints.decorators import stream_flag
from ember.errors import InputError
from ember.wire import messages as wire
from ember_worker.replica.batching import Batcher
from ember_worker.replica.channel import Send
from ember_worker.replica.results import ResultSender, ResultTooLargeError
from ember_worker.replica.user_code import UserCode
from ember_worker.replica.web_requests import WebRequests

_DONE = object()


class InvalidArguments(Exception):
    """The caller's keyword arguments do not fit the method's signature."""


def _iterator_for_plain_call(func: Callable[..., Any]) -> str:
    flag = stream_flag(func)
    return (
        f"{getattr(func, '__qualname__', 'the method')} returned an iterator for a call that "
        f"did not ask to stream ({flag} was not true)"
    )


class ArgumentBinder:
    def __init__(self) -> None:
        # Per function: its signature, parameter hints, defaults, parameters that hold
        # bytes (with their hints) and structured ones (Pydantic models, dataclasses),
        # read once.
        self._known: dict[
            Callable[..., Any],
            tuple[
                inspect.Signature, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]
            ],
        ] = {}

    def bind(self, func: Callable[..., Any], body: str) -> dict[str, Any]:
        """The call's keyword arguments for `func`, from its JSON body (InvalidArguments
        if they do not fit)."""
        kwargs = json.loads(body) if body else {}
        known = self._known.get(func)
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
            known = self._known[func] = (signature, hints, defaults, binary, built)
        signature, hints, defaults, binary, built = known
        name = getattr(func, "__name__", "endpoint")
        try:
            for (
                parameter,
                hint,
            ) in binary.items():  # base64 in JSON: see ember.declarations.parameters
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


class InputRunner:
    def __init__(
        self,
        code: UserCode,
        executor: Executor,
        *,
        results: ResultSender,
        web: WebRequests,
        send: Send,
        ended: Callable[[str], None],
    ) -> None:
        self.code = code
        self.executor = executor  # where sync code runs, up to `concurrency` at once
        self.results = results
        self.web = web  # a web-app endpoint's inputs
        self.send = send
        self.ended = ended  # told of each input that ends, to forget what it kept
        self.arguments = ArgumentBinder()
        self.tasks: dict[str, asyncio.Task[None]] = {}  # the inputs running, by id
        self.sending: set[asyncio.Future[None]] = set()  # held: the loop keeps tasks weakly
        self._batchers: dict[str, Batcher] = {}

    def start(
        self,
        flag: cancellation.InputFlag,
        method: str,
        body: str,
        stream: bool,
        echo: bool = False,
    ) -> None:
        """Run an input; `flag` names it, and is what its code reads. An `echo` is a gang
        member's copy of rank 0's input: only how it ended is sent."""
        input_id = flag.input_id
        if echo:
            self.results.echo(input_id)
        task = asyncio.ensure_future(self._run(flag, method, body, stream))
        self.tasks[input_id] = task
        task.add_done_callback(lambda done: self._input_done(input_id, done))

    def cancel(self, input_id: str) -> None:
        running = self.tasks.get(input_id)
        # Once only: a second cancel would cut short its wait for the input's thread.
        if running is not None and not running.cancelling():
            running.cancel()

    def _input_done(self, input_id: str, task: asyncio.Task[None]) -> None:
        self.tasks.pop(input_id, None)
        self.results.forget(input_id)  # also of one cancelled before its first step
        self.ended(input_id)
        if task.cancelled():
            # Cancelled before its first step (its input and cancel came in one read), so
            # its own handler never ran to say so; unsaid, the platform holds the slot
            # until the endpoint's timeout.
            print(f"ember: input {input_id} cancelled before it started", file=sys.stderr)
            said = asyncio.ensure_future(self.send(wire.Cancelled(id=input_id)))
            self.sending.add(said)
            said.add_done_callback(self.sending.discard)

    async def _run(
        self, gone: cancellation.InputFlag, method: str, body: str, stream: bool
    ) -> None:
        """Run one input. `gone` is what `ember.cancelled()` (and `current_affinity_key()`)
        read in the input's code; calls it makes name the input as their parent."""
        input_id = gone.input_id
        work: asyncio.Future[Any] | None = None  # a sync call's thread, which cannot be stopped
        cancellation.bind_task(gone)  # this task is the input's own: async code sees it
        try:
            if self.code.web_app is not None:
                await self.web.serve(input_id, body)
                return
            func = self.code.target(method)
            kwargs = self.arguments.bind(func, body)
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
                await self.results.result(input_id, func, result)
            elif inspect.isasyncgenfunction(func):
                async for item in func(**kwargs):
                    await self.results.event(input_id, func, item)
                await self.results.end(input_id)
            elif inspect.isgeneratorfunction(func):
                loop = asyncio.get_running_loop()
                generator = await loop.run_in_executor(self.executor, lambda: func(**kwargs))
                await self._stream_sync(input_id, func, generator, gone)
            elif inspect.iscoroutinefunction(func):
                result = await func(**kwargs)
                await self.results.result(input_id, func, result)
            else:
                loop = asyncio.get_running_loop()
                work = loop.run_in_executor(
                    self.executor, cancellation.bound(gone, lambda: func(**kwargs))
                )
                result = await asyncio.shield(work)
                await self.results.result(input_id, func, result)
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
            await self.send(wire.Cancelled(id=input_id))
        except ResultTooLargeError as exc:
            print(f"ember: input {input_id}: {exc}", file=sys.stderr)
            await self.send(
                wire.Error(id=input_id, status=500, error_type="result_too_large", message=str(exc))
            )
        except InputError as exc:
            await self.send(
                wire.Error(
                    id=input_id,
                    status=exc.status,
                    error_type=exc.error_type,
                    message=str(exc),
                    param=exc.param if isinstance(exc.param, str) else None,
                    code=exc.code if isinstance(exc.code, str) else None,
                )
            )
        except InvalidArguments as exc:
            await self.send(
                wire.Error(
                    id=input_id, status=400, error_type="invalid_arguments", message=str(exc)
                )
            )
        except (SystemExit, KeyboardInterrupt):
            raise  # the code asked for its process to end: the replica does (502 for it)
        except BaseException as exc:  # an Exception, or a BaseException of the code's own
            traceback.print_exc()
            await self._send_error(input_id, exc)
        finally:
            self.results.forget(input_id)

    async def _send_error(self, input_id: str, exc: BaseException) -> None:
        """The input failed in its code: 500 with the exception's type and message."""
        error_type, message = type(exc).__name__, str(exc) or repr(exc)
        await self.send(wire.Error(id=input_id, status=500, error_type=error_type, message=message))

    def _batcher(self, method: str, func: Callable[..., Any], settings: BatchSettings) -> Batcher:
        """One batcher per method for the replica's life: its inputs meet there."""
        batcher = self._batchers.get(method)
        if batcher is None:
            batcher = self._batchers[method] = Batcher(func, settings, self.executor)
        return batcher

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
                await self.results.event(input_id, func, item)
            await self.results.end(input_id)
        elif isinstance(result, Iterator):
            if not stream:
                loop = asyncio.get_running_loop()
                if hasattr(result, "close"):
                    await loop.run_in_executor(self.executor, result.close)
                raise TypeError(_iterator_for_plain_call(func))
            await self._stream_sync(input_id, func, result, gone)
        elif stream:  # one value for a streaming call: a stream of one event
            await self.results.event(input_id, func, result)
            await self.results.end(input_id)
        else:
            await self.results.result(input_id, func, result)

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
                await self.results.event(input_id, func, item)
            await self.results.end(input_id)
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
