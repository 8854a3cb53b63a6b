"""`ember.cancelled()`: whether the caller of the input being worked on has gone.

A sync function runs in a thread the platform cannot stop: when its caller disconnects
(or the call is cancelled), the replica waits for it before the slot is free again. Long
work can ask `ember.cancelled()` between steps and stop early instead. The replica's
runtime binds each input's flag to the thread (or the task) that runs it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Sent with every call made while an input runs, so that the platform can end calls made
# for an input when that input ends (its caller left, it timed out) and log who made them.
PARENT_CALL_HEADER = "X-Ember-Parent-Call-Id"


class InputFlag(threading.Event):
    """An input's cancelled flag, which also names the input, its affinity key, its
    trace and its priority."""

    def __init__(
        self,
        input_id: str,
        affinity: str | None = None,
        trace: str | None = None,
        priority: int = 1,
    ) -> None:
        super().__init__()
        self.input_id = input_id
        self.affinity = affinity
        self.trace = trace  # its `traceparent` (ember.calling.tracing)
        self.priority = priority  # its rank in ember.calling.priority.PRIORITIES


_thread = threading.local()  # sync code: the executor thread running the input
_task: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "ember_input_cancelled", default=None
)


def cancelled() -> bool:
    """Whether the input this code runs for was cancelled: its caller disconnected, or
    the call was cancelled. Always False outside a replica's input."""
    flag = _task.get() or getattr(_thread, "flag", None)
    return flag is not None and flag.is_set()


def current_input_flag() -> threading.Event | None:
    """The flag of the input this code runs for; None outside one."""
    return _task.get() or getattr(_thread, "flag", None)


def current_call_id() -> str | None:
    """The id of the call this code runs for: the answer's `X-Ember-Call-Id`, a spawned
    call's `CallHandle.call_id`, what `ember logs --call` takes. None outside a replica's
    input (in `enter` hooks, for one)."""
    return getattr(current_input_flag(), "input_id", None)


def bound(flag: threading.Event, func: Callable[..., T]) -> Callable[..., T]:
    """`func` as run for one input in a worker thread: `cancelled()` reads `flag` there."""

    def run(*args: Any) -> T:
        previous = getattr(_thread, "flag", None)
        _thread.flag = flag
        try:
            return func(*args)
        finally:
            _thread.flag = previous

    return run


def carried(func: Callable[..., T]) -> Callable[..., T]:
    """`func`, to run on another thread for the input this code runs for: there too,
    `cancelled()` reads its flag and calls name it as their parent."""
    flag = _task.get() or getattr(_thread, "flag", None)
    return func if flag is None else bound(flag, func)


def bind_task(flag: threading.Event) -> None:
    """For async code: the current task (and what it awaits) reads `flag`."""
    _task.set(flag)
