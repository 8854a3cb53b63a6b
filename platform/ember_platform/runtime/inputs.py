"""One input (a call of an endpoint method) on its way through the control plane."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.calling.priority import NORMAL, PRIORITIES
from ember.calling.tracing import TraceContext
from ember.files import content_disposition
from ember_platform.errors import error_body
from ember_platform.limits.held_bytes import HeldBytes, workspace_of

JSON_MEDIA_TYPE = "application/json"


@dataclass(frozen=True)
class Outcome:
    """How an input ended: the HTTP status and body the caller gets, JSON unless the code
    returned a file (`ember.File`, bytes)."""

    status: int
    # A large result taken in by pieces is the bytearray they went into: never copied
    # whole on the event loop (60 MB took it 15 ms and more).
    body: bytes | bytearray
    media_type: str = JSON_MEDIA_TYPE
    filename: str | None = None

    def headers(self) -> dict[str, str]:
        """The response headers that say what the body is."""
        headers = {"Content-Type": self.media_type}
        if self.filename is not None:
            headers["Content-Disposition"] = content_disposition(self.filename)
        return headers

    @classmethod
    def error(
        cls, status: int, error_type: str, message: str, fields: dict[str, Any] | None = None
    ) -> Outcome:
        return cls(status, error_body(error_type, message, fields))


# Items of a streaming input's event queue.
class InputPhase(enum.Enum):
    """What an input's one timer counts down, phase by phase (`Input.arm`)."""

    QUEUED = "queue_timeout"  # waiting for a replica (a synchronous call's queue_timeout=)
    RUNNING = "lease"  # on a replica: the endpoint's timeout=
    CANCELLING = "cancel_wait"  # stopped: how long its replica has to say the work stopped
    BACKING_OFF = "retry_backoff"  # its code raised: the wait before it runs again


EVENT = "event"  # a JSON value: a server-sent event
CHUNK = "chunk"  # bytes of a stream that is a file
END = "end"
ERROR = "error"  # the stream failed: its error's body


# A batch's requests (batches/runner.py) run at the lowest priority, as spawned calls whose
# ids begin so: their batch, not the generic recovery, takes them up after a restart.
BATCH_PRIORITY = PRIORITIES.index("low")
BATCH_CALL_PREFIX = "batch_"


def is_batch_call(call_id: str) -> bool:
    return call_id.startswith(BATCH_CALL_PREFIX)


@dataclass(eq=False)
class Input:
    id: str
    label: str
    method: str
    body: bytes
    streaming: bool
    is_async: bool  # a durable call (Prefer: respond-async)
    parent_id: str | None = None  # the input whose code made this call, if one did
    webhook: str | None = None  # an async call's URL to tell of its end (X-Ember-Webhook)
    priority: int = NORMAL  # its place in the queue: 0 high, 1 normal, 2 low
    affinity: str | None = None  # its affinity key (X-Ember-Affinity): see affinity.py
    prefix: tuple[bytes, ...] | None = None  # its prompt's block hashes (prefix_routing.py)
    canary: bool = False  # sent to its endpoint's canary (canaries.route)
    trace: TraceContext | None = None  # its W3C trace context (ember.calling.tracing)
    timeout: float | None = None  # its own limit in seconds (X-Ember-Timeout), from arrival
    attempts: int = 0
    # In flight with others on a replica that crashed: it may be the one that crashed it,
    # or a neighbour. It runs alone until it ends, so that a crash can be laid at its door.
    suspect: bool = False
    created_at: float = field(default_factory=time.time)
    replica_id: str | None = None
    dispatched_at: float | None = None
    emitted: bool = False  # a stream sent at least one event: it can no longer be retried
    done: bool = False
    outcome: asyncio.Future[Outcome] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # Streams: (EVENT, data) items, then (END, None) on success; errors set `outcome`.
    # Only synchronous streams have this queue: creating one per call costs. Each item
    # carries its size on the replica's channel, for the stream's flow control.
    events: asyncio.Queue[tuple[str, bytes | None, int]] = field(init=False, repr=False)
    taken_bytes: int = 0  # of its events, as sent on the channel, taken for the caller
    acked_bytes: int = 0  # of those, what the replica was told (see STREAM_WINDOW_BYTES)
    collected: list[bytes] = field(default_factory=list)  # stream events of an async call
    collected_bytes: int = 0
    inbox: list[bytes] | None = None  # a WebSocket's messages before dispatch (rare)
    # A stream of bytes: its media type and file name, from its first chunk.
    file: tuple[str, str | None] | None = None
    timer: asyncio.TimerHandle | None = None  # armed for `phase`, and only by `arm`
    phase: InputPhase | None = None
    # Bytes of its result and events held, and whether its body is (LiveState.answers,
    # LiveState.bodies).
    held_bytes: int = 0
    body_held: bool = False
    # A large result's pieces (ResultPart) so far, and how many, taken in as they come.
    result_parts: bytearray = field(default_factory=bytearray)
    result_pieces: int = 0
    deadline_timer: asyncio.TimerHandle | None = None  # its own limit's (see `timeout`)

    def __post_init__(self) -> None:
        if self.streaming and not self.is_async:
            self.events = asyncio.Queue()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop it lives in (asking asyncio for the running one costs a system
        call on Python 3.11, which the hot path pays once per input, here)."""
        return self.outcome.get_loop()

    def arm(self, phase: InputPhase, seconds: float, then: Callable[..., None], *args: Any) -> None:
        """Its timer for `phase`, calling `then(*args)` after `seconds`: the timer of the
        phase before, if any is left, no longer counts."""
        self.disarm()
        self.phase = phase
        self.timer = self.loop.call_later(seconds, then, *args)

    def disarm(self) -> None:
        """No phase of its is timed any more (it is queued again, or answered)."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.phase = None

    def add_event(self, kind: str, data: bytes | None, size: int = 0) -> None:
        """Queue an item of a synchronous stream; `size` is its body's on the channel."""
        self.events.put_nowait((kind, data, size))

    async def next_event(self) -> tuple[str, bytes | None]:
        """The stream's next item, counted as taken for the caller."""
        kind, data, size = await self.events.get()
        self.taken_bytes += size
        return kind, data

    def queued_events(self) -> list[tuple[str, bytes | None]]:
        """Take every item queued now, without waiting (for tests and diagnostics)."""
        items = []
        while not self.events.empty():
            kind, data, size = self.events.get_nowait()
            self.taken_bytes += size
            items.append((kind, data))
        return items


def hold_body(bodies: HeldBytes, inp: Input) -> None:
    if not inp.body_held:
        bodies.hold(workspace_of(inp.label), len(inp.body))
        inp.body_held = True


def release_body(bodies: HeldBytes, inp: Input) -> None:
    if inp.body_held:
        bodies.release(workspace_of(inp.label), len(inp.body))
        inp.body_held = False


def hold_for(held: HeldBytes, inp: Input, size: int) -> None:
    """Count `size` bytes of the input's answers (its result, an event) as held."""
    held.hold(workspace_of(inp.label), size)
    inp.held_bytes += size


def release_for(held: HeldBytes, inp: Input, size: int | None = None) -> None:
    """No longer hold `size` bytes of the input's (None: all it holds)."""
    size = inp.held_bytes if size is None else min(size, inp.held_bytes)
    held.release(workspace_of(inp.label), size)
    inp.held_bytes -= size
