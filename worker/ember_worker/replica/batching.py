"""The replica side of `@ember.batched`: inputs of one method gathered into one call."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from ember.endpoints.batching import BatchSettings


class BatchResultError(TypeError):
    """A batched function's return value does not give one result per input."""


class Batcher:
    """Collects the keyword arguments of concurrent inputs; calls `func` once per batch
    with a list per parameter; hands each input its own result (or the call's error)."""

    def __init__(
        self, func: Callable[..., Any], settings: BatchSettings, executor: Executor
    ) -> None:
        self.func = func
        self.settings = settings
        self.executor = executor
        self.signature = inspect.signature(func)
        self._waiting: list[tuple[dict[str, Any], asyncio.Future[Any]]] = []
        self._timer: asyncio.Handle | None = None  # the pending flush
        self._running: set[asyncio.Task[None]] = set()
        self.sizes: list[int] = []  # of the batches run so far, for logs and tests

    async def submit(self, kwargs: dict[str, Any]) -> Any:
        """This input's result, once its batch has run."""
        bound = self.signature.bind(**kwargs)
        bound.apply_defaults()  # every input names every parameter: lists line up
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Any] = loop.create_future()
        self._waiting.append((dict(bound.arguments), result))
        if len(self._waiting) >= self.settings.max_batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.settings.wait_ms / 1000, self._flush)
        return await result

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        size = self.settings.max_batch_size
        batch, self._waiting = self._waiting[:size], self._waiting[size:]
        if self._waiting:  # more than a batch came at once: the rest wait their turn
            self._timer = asyncio.get_running_loop().call_soon(self._flush)
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[dict[str, Any], asyncio.Future[Any]]]) -> None:
        columns = {name: [arguments[name] for arguments, _ in batch] for name in batch[0][0]}
        self.sizes.append(len(batch))
        try:
            if inspect.iscoroutinefunction(self.func):
                results = await self.func(**columns)
            else:
                loop = asyncio.get_running_loop()
                results = await loop.run_in_executor(self.executor, lambda: self.func(**columns))
            if not isinstance(results, list | tuple) or len(results) != len(batch):
                got = len(results) if isinstance(results, list | tuple) else type(results).__name__
                raise BatchResultError(
                    f"{self.func.__qualname__} is batched: it must return a list with one "
                    f"result per input ({len(batch)}), not {got}"
                )
        except Exception as exc:
            for _, future in batch:
                if not future.done():  # a cancelled input's future is done already
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
