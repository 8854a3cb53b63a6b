"""The replica's side of its channel to the control plane: each message framed as
`ember.wire.messages` says (a typed header, then its body), several batched into one
WebSocket message split apart on the way in, a stream's events held to their
flow-control window on the way out, and a heartbeat every second (with the code's own
metrics and its weights' read totals)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, WebSocketException

from ember import user_metrics
from ember.wire import messages as wire
from ember_worker.channel_url import open_channel
from ember_worker.identity import ReplicaIdentity
from ember_worker.replica.loaded_weights import weights_read_totals
from ember_worker.replica.stream_windows import StreamWindow

HEARTBEAT_SECONDS = 1.0
# Between tries to open the channel again: a new owner refuses it until its worker's
# hello has named this replica, within a second or so of the takeover.
REOPEN_PAUSE_SECONDS = 0.2


class Send(Protocol):
    """A message to the control plane: its header, and its body (text) if it has one."""

    def __call__(self, header: wire.FromReplica, body: str = "", /) -> Awaitable[None]: ...


class Connection(Protocol):
    """What the replica sends on: the channel's WebSocket (or a test's stand-in)."""

    async def send(self, message: str) -> None: ...


class ReplicaChannel:
    def __init__(self, connection: Connection | None = None) -> None:
        self.connection = connection  # None until open() connects
        self.windows: dict[str, StreamWindow] = {}  # streaming inputs' flow control

    @contextlib.asynccontextmanager
    async def open(self, identity: ReplicaIdentity) -> AsyncIterator[ClientConnection]:
        """The channel to the control plane, as this replica's identity names it."""
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
            self.connection = ws
            yield ws

    async def reopen(
        self, identity: ReplicaIdentity, seconds: float, stop: asyncio.Event
    ) -> ClientConnection | None:
        """The channel again after it closed (its control plane died, and another takes
        over), tried at each of the platform's addresses in turn for up to `seconds`;
        None if none would have it, or once `stop` is set. What the old channel's
        streams sent goes unanswered, so their windows no longer hold them back."""
        for window in self.windows.values():
            window.release()
        self.connection = None
        urls = [identity.server_url, *(u for u in identity.server_urls if u != identity.server_url)]
        deadline = time.monotonic() + seconds
        attempt = 0
        while time.monotonic() < deadline and not stop.is_set():
            url = urls[attempt % len(urls)]
            attempt += 1
            try:
                ws = await open_channel(
                    url,
                    f"/v1/replicas/{identity.replica_id}/channel",
                    channel_socket=identity.channel_socket,
                    ca_cert=identity.ca_cert,
                    additional_headers={"Authorization": f"Bearer {identity.token}"},
                    max_size=None,
                    ping_interval=None,
                    compression=None,
                    open_timeout=max(0.5, min(5.0, deadline - time.monotonic())),
                )
            except (OSError, WebSocketException, TimeoutError):
                await asyncio.sleep(REOPEN_PAUSE_SECONDS)
                continue
            self.connection = ws
            return ws
        return None

    async def send(self, header: wire.FromReplica, body: str = "") -> None:
        """One message; a stream's event then waits while its window is full."""
        if self.connection is not None:
            with contextlib.suppress(ConnectionClosed):
                await self.connection.send(wire.frame(header, body))
        if isinstance(header, wire.Event):
            window = self.windows.get(header.id)
            if window is None:
                window = self.windows[header.id] = StreamWindow()
            await window.after_send(len(body))

    def acknowledged(self, input_id: str, count: int) -> None:
        """The control plane took `count` bytes of the input's stream so far."""
        window = self.windows.get(input_id)
        if window is not None:
            window.acknowledged(count)

    def forget(self, input_id: str) -> None:
        """The input has ended: its stream's window goes."""
        self.windows.pop(input_id, None)

    async def read(self, ws: ClientConnection, dispatch: Callable[[str], None]) -> None:
        """Each message in turn to `dispatch`, until the channel closes."""
        with contextlib.suppress(ConnectionClosed):
            async for frame_text in ws:
                text = frame_text if isinstance(frame_text, str) else frame_text.decode()
                for message in wire.records(text):
                    dispatch(message)

    async def heartbeat(self, ws: ClientConnection) -> None:
        plain = wire.frame(wire.ReplicaHeartbeat())
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            weights = weights_read_totals()
            metrics = user_metrics.snapshot()  # the code's own: ember.Counter, Gauge, Histogram
            if weights is None and not metrics:
                await ws.send(plain)
                continue
            beat = wire.ReplicaHeartbeat(weights=weights, metrics=metrics or None)
            await ws.send(wire.frame(beat))
