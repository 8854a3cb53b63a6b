"""The node's channel to the control plane: opened with the worker's token, a hello that
registers the node, then the control plane's commands read in turn (decoded as
`ember.wire.messages` types them; one that does not fit is logged and dropped) while the
session's own tasks (heartbeats, log shipping) run beside; opened again whenever it drops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.channel_url import open_channel

log = logging.getLogger("ember.worker")

# Between tries to reach the control plane: short, so that a node is back with the next
# owner within a second or so of a failover (one of several processes taking over).
MAX_BACKOFF_S = 1.0

Send = Callable[[wire.FromAgent], Coroutine[Any, Any, None]]  # a message to the control plane
Handle = Callable[[wire.ToAgent], None]  # a command from it
SessionTasks = Callable[[ClientConnection], list[Coroutine[Any, Any, None]]]


class NodeRefused(Exception):
    """The control plane said why it will not take this node (its answer to the hello)."""


def refusal_reason(body: bytes | None) -> str:
    """Why the control plane refused the channel's handshake, from its answer's JSON
    error; an older control plane answers with no body."""
    with contextlib.suppress(ValueError, TypeError, KeyError):
        message = json.loads(body or b"")["error"]["message"]
        if isinstance(message, str) and message:
            return message
    return "it is wrong, revoked or expired, or not a worker token"


class ControlChannel:
    def __init__(
        self,
        config: AgentConfig,
        *,
        stopping: asyncio.Event,
        leaving: asyncio.Event,
        hello: Callable[[], wire.Hello],
        handle: Handle,
        session_tasks: SessionTasks,
        after_session: Callable[[], Awaitable[None]],
    ) -> None:
        self.config = config
        self.stopping = stopping  # set: no session again
        self.leaving = leaving  # set: the node is leaving, so a lost session ends it
        self.hello = hello  # the node's registration, as it stands when a session opens
        self.handle = handle
        self.session_tasks = session_tasks  # run while a session lasts
        self.after_session = after_session
        self.ws: ClientConnection | None = None  # the open session's connection
        self.refused: str | None = None  # why the control plane will not have this node

    @property
    def connected(self) -> bool:
        return self.ws is not None

    async def send(self, message: wire.FromAgent) -> None:
        """To the control plane, if connected (else, or if the channel closes, dropped)."""
        if self.ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await self.ws.send(wire.encode(message))

    async def serve(self) -> None:
        """Sessions, one after another, until `stopping`; after each, `after_session`."""
        backoff = 0.2
        while not self.stopping.is_set():
            session = asyncio.ensure_future(self._session())
            stop = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait({session, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not session.done():
                session.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await session
                    backoff = 0.2
                except InvalidStatus as exc:
                    if exc.response.status_code in (401, 403):
                        # Its token will not change by itself: trying again cannot help.
                        self.refused = (
                            "the control plane refused this worker's token (HTTP "
                            f"{exc.response.status_code}): {refusal_reason(exc.response.body)}; "
                            "start the worker with a worker token (`ember token create "
                            "--scope worker`)"
                        )
                        log.error("%s", self.refused)
                        self.stopping.set()
                    else:
                        log.error("the control plane refused this worker: %s", exc)
                        self.config.next_server()
                except NodeRefused as exc:
                    # It may pass: a namesake that is going away, say.
                    log.error("the control plane refused this worker: %s; trying again", exc)
                    backoff = 5.0
                except (OSError, WebSocketException, TimeoutError) as exc:
                    log.warning("control plane unreachable (%s); retrying", exc)
                    self.config.next_server()
            await self.after_session()
            if self.leaving.is_set():
                self.stopping.set()  # the control plane went away while this node left
            if not self.stopping.is_set():
                # A stop asked meanwhile ends the wait (a control plane that closed this
                # channel as it stops, then stops its local worker, is not kept waiting).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _session(self) -> None:
        async with open_channel(
            self.config.server_url,
            "/v1/workers/channel",
            channel_socket=self.config.channel_socket,
            ca_cert=self.config.ca_cert,
            additional_headers={"Authorization": f"Bearer {self.config.token}"},
            max_size=None,
            ping_interval=None,
            open_timeout=10,
        ) as ws:
            await ws.send(wire.encode(self.hello()))
            welcome = answer_to_hello(await ws.recv())
            log.info("registered as %s", welcome.worker_id)
            self.ws = ws
            background = [asyncio.ensure_future(task) for task in self.session_tasks(ws)]
            try:
                await self.read(ws)
            except ConnectionClosed:
                pass
            finally:
                self.ws = None
                for task in background:
                    task.cancel()

    async def read(self, frames: AsyncIterable[str | bytes]) -> None:
        """Each command in turn to `handle`, until the channel closes; one that does not
        fit its type (a control plane of another release, or a bug) is logged and
        dropped, and the session goes on."""
        async for text in frames:
            try:
                command = wire.to_agent(text)
            except wire.WireError as error:
                log.warning("dropped a message from the control plane: %s", error)
                continue
            self.handle(command)


def answer_to_hello(text: str | bytes) -> wire.Welcome:
    """The control plane's answer to the hello: its welcome, or NodeRefused saying why
    not (its refusal, or an answer that is not one)."""
    try:
        answer = wire.to_agent(text)
    except wire.WireError as error:
        raise NodeRefused(f"its answer to the hello was not understood ({error})") from None
    if isinstance(answer, wire.Refused):
        raise NodeRefused(answer.reason or "no reason given")
    if not isinstance(answer, wire.Welcome):
        raise NodeRefused(f"it answered the hello with {type(answer).__name__}, not a welcome")
    return answer
