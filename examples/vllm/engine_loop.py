"""vLLM's engine stepped by one thread: requests from any thread go in between steps, and
each request's outputs come back through a queue of its own.

vLLM's `LLMEngine` is not thread-safe and runs nothing by itself: whoever calls `step()`
schedules the next batch (continuous batching: requests added between steps join the
running ones). Here one thread owns it; the replica's request threads only hand it work.
It is started after the snapshot (`start()` in a plain `enter` hook), so the image holds
the engine at rest and no thread of ours.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

_DONE = object()  # a request's last item in its queue


class EngineLoop:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[tuple[str, Any, Any, queue.SimpleQueue[Any], int]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
            self._thread.start()

    def run_alone(self, prompt: Any, params: Any) -> list[Any]:
        """One request stepped to its end on the calling thread, before `start()`: the
        warm-up in `enter(snap=True)`."""
        request_id = f"warm-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params)
        outputs = []
        while self.engine.has_unfinished_requests():
            outputs.extend(self.engine.step())
        return outputs

    def generate(self, prompt: Any, params: Any, priority: int = 1) -> Iterator[Any]:
        """The request's `RequestOutput`s as the engine makes them; leaving the iterator
        early (a stop, a caller gone) aborts the request. A lower `priority` is
        scheduled first (with the engine's scheduling_policy="priority")."""
        request_id = f"req-{next(self._ids)}"
        outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._wake:
            self._adds.append((request_id, prompt, params, outputs, priority))
            self._wake.notify()
        finished = False
        try:
            while True:
                item = outputs.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                with self._wake:
                    self._aborts.append(request_id)
                    self._wake.notify()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not self._adds and not self._aborts and not engine.has_unfinished_requests():
                    self._wake.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            for request_id, prompt, params, outputs, priority in adds:
                try:
                    engine.add_request(request_id, prompt, params, priority=priority)
                except Exception as error:  # vLLM refused it (too long, bad params)
                    outputs.put(error)
                    continue
                self._queues[request_id] = outputs
            live = [r for r in aborts if self._queues.pop(r, None) is not None]
            if live:
                engine.abort_request(live)
            if not engine.has_unfinished_requests():
                continue
            try:
                stepped = engine.step()
            except Exception as error:  # every request in flight fails with it
                for outputs in self._queues.values():
                    outputs.put(error)
                self._queues.clear()
                continue
            for output in stepped:
                waiting = self._queues.get(output.request_id)
                if waiting is None:
                    continue
                waiting.put(output)
                if output.finished:
                    del self._queues[output.request_id]
                    waiting.put(_DONE)
