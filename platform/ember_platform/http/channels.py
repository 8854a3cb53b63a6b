"""WebSocket channels: the long-lived links from worker agents and replicas.

They are served on the control plane's HTTPS port, and for its local worker also on a
Unix socket (`ember.calling.unix_channel`), by a server of their own that serves nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ember.wire import messages as wire
from ember.wire.labels import split_app_key
from ember_platform.core.cluster import Cluster
from ember_platform.core.workers import WorkerNameTaken
from ember_platform.http.https_server import GatewayLimits, limited_protocol
from ember_platform.runtime.cluster_model import Worker
from ember_platform.security.tokens import Scope, TokenRegistry, bearer_hash

POLICY_VIOLATION = 1008
log = logging.getLogger("ember.channels")
MAX_BATCH = 64
ANSWER_ROOM_POLL_SECONDS = 1.0
# A replica's frame may batch many messages: the loop serves others between this many.
RECORDS_BETWEEN_YIELDS = 256


async def _pump(websocket: WebSocket, outbox: asyncio.Queue[str], *, batch: bool) -> None:
    """Send queued messages in order; an empty string closes the channel.

    With `batch`, messages queued meanwhile share one frame (one TLS record, one system
    call), separated by `wire.RECORD_SEPARATOR`.
    """
    while True:
        messages = [await outbox.get()]
        while batch and not outbox.empty() and len(messages) < MAX_BATCH:
            messages.append(outbox.get_nowait())
        closing = "" in messages
        messages = messages[: messages.index("")] if closing else messages
        if messages:
            await websocket.send_text(wire.RECORD_SEPARATOR.join(messages))
        if closing:
            with contextlib.suppress(Exception):
                await websocket.close()
            return


WORKER_CHANNEL_PATH = "/v1/workers/channel"
REPLICA_CHANNEL_PATH = "/v1/replicas/{replica_id}/channel"


async def _deny(websocket: WebSocket, status: int, reason: str) -> None:
    """Refuse a handshake with an HTTP answer that says why (the agent prints it), where
    the server can send one; otherwise with a bare close (HTTP 403)."""
    if "websocket.http.response" not in websocket.scope.get("extensions", {}):
        await websocket.close(code=POLICY_VIOLATION)
        return
    body = {"error": {"type": "unauthorized" if status == 401 else "forbidden", "message": reason}}
    await websocket.send_denial_response(JSONResponse(body, status_code=status))


def _hello(text: str) -> wire.Hello:
    """A worker's first message, which must be its hello (else WireError, saying why)."""
    message = wire.from_agent(text)
    if not isinstance(message, wire.Hello):
        raise wire.WireError(f"it sent {type(message).__name__} first, not a hello")
    return message


class Channels:
    def __init__(self, cluster: Cluster, tokens: TokenRegistry) -> None:
        self.cluster = cluster
        self.tokens = tokens
        self._worker_tokens: dict[str, str] = {}  # worker id -> hash of the token it joined with
        tokens.on_revoke(self._token_revoked)

    def _token_revoked(self, token_hash: str) -> None:
        """A revoked token keeps no worker joined: their channels close now."""
        for worker_id, joined_with in list(self._worker_tokens.items()):
            worker = self.cluster.workers.get(worker_id)
            if joined_with == token_hash and worker is not None:
                worker.outbox.put_nowait("")  # the pump closes the channel

    async def worker(self, websocket: WebSocket) -> None:
        authorization = websocket.headers.get("authorization")
        scope = self.tokens.scope_of(authorization)
        if scope is None:
            await _deny(websocket, 401, "the token is unknown: wrong, revoked or expired")
            return
        if not scope.allows(Scope.WORKER):
            await _deny(websocket, 403, f"it is an {scope.value} token, not a worker token")
            return
        await websocket.accept()
        try:
            hello = _hello(await websocket.receive_text())
            worker = self.cluster.register_worker(hello)
        except WebSocketDisconnect:
            return
        except ValueError as exc:  # a WireError, or WorkerNameTaken
            if isinstance(exc, WorkerNameTaken):
                reason = str(exc)
            else:  # an agent of another release, or a bug: both sides say what it was
                reason = f"its hello was not understood ({exc})"
                log.warning("a worker was refused: %s", reason)
            # Said before the close, so the agent can tell its operator what to change.
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await websocket.send_text(wire.encode(wire.Refused(reason=reason)))
            await websocket.close(code=POLICY_VIOLATION)
            return
        self._worker_tokens[worker.id] = bearer_hash(authorization) or ""
        # The HTTPS port only takes TLS: a plain channel came in on the Unix socket.
        worker.channel = "https" if websocket.scope.get("scheme") == "wss" else "unix socket"
        await websocket.send_text(wire.encode(wire.Welcome(worker_id=worker.id)))
        pump = asyncio.ensure_future(_pump(websocket, worker.outbox, batch=False))
        # A token that expires keeps its worker joined only until then, as a revoke would.
        grant = self.tokens.grant_of(authorization)
        expiry = None
        if grant is not None and grant.expires_at is not None:
            delay = max(0.0, grant.expires_at - time.time())
            expiry = asyncio.get_running_loop().call_later(delay, worker.outbox.put_nowait, "")
        try:
            # Until the client leaves, or the pump closes the channel (a revoked token).
            receiving = asyncio.ensure_future(self._receive(websocket, worker))
            await asyncio.wait({pump, receiving}, return_when=asyncio.FIRST_COMPLETED)
            receiving.cancel()
        finally:
            pump.cancel()
            if expiry is not None:
                expiry.cancel()
            self._worker_tokens.pop(worker.id, None)
            self.cluster.roster.gone(worker, "disconnected")

    async def _receive(self, websocket: WebSocket, worker: Worker) -> None:
        # Each message is decoded apart: one that does not fit is logged and dropped
        # (ChannelMessages), and the session goes on.
        with contextlib.suppress(WebSocketDisconnect, ValueError, RuntimeError):
            while True:
                self.cluster.messages.from_worker(worker, await websocket.receive_text())

    async def replica(self, websocket: WebSocket) -> None:
        replica = self.cluster.replicas.get(websocket.path_params["replica_id"])
        presented = (websocket.headers.get("authorization") or "").removeprefix("Bearer ")
        if replica is None or not hmac.compare_digest(presented, replica.token):
            await websocket.close(code=POLICY_VIOLATION)
            return
        await websocket.accept()
        outbox: asyncio.Queue[str] = asyncio.Queue()
        replica.outbox = outbox
        pump = asyncio.ensure_future(_pump(websocket, outbox, batch=True))
        # Its code may call its workspace's endpoints (and reach its Dicts, Queues and
        # Volumes) while it is connected; a closed channel ends it.
        workspace = split_app_key(replica.endpoint.app)[0]
        self.tokens.add_ephemeral(replica.call_token, Scope.INVOKE, workspace)
        answers = self.cluster.state.answers
        try:
            while True:
                records = wire.records(await websocket.receive_text())
                for count, message in enumerate(records, 1):
                    self.cluster.messages.from_replica(replica, message)
                    while answers.full(workspace) and not replica.mid_result:
                        # Its workspace holds its budget of results and events: they
                        # wait in this replica (its channel is read no further) until
                        # callers take theirs. It is paused, not silent. Only a result's
                        # pieces sent one after the other go on (halves are bounded,
                        # channel_messages.py): any other message, a whole result among
                        # them, is followed by this check.
                        await answers.room(workspace, ANSWER_ROOM_POLL_SECONDS)
                        replica.last_seen = time.time()
                    if not count % RECORDS_BETWEEN_YIELDS:
                        await asyncio.sleep(0)  # a frame of many messages: others go on
        except (WebSocketDisconnect, ValueError, KeyError):
            pass
        finally:
            pump.cancel()
            self.tokens.remove_ephemeral(replica.call_token)
            self.cluster.messages.replica_disconnected(replica)

    def routes(self) -> list[WebSocketRoute]:
        return [
            WebSocketRoute(WORKER_CHANNEL_PATH, self.worker),
            WebSocketRoute(REPLICA_CHANNEL_PATH, self.replica),
        ]


class ChannelServer(uvicorn.Server):
    """Serves only the channels, on the local Unix socket, beside the HTTPS server.

    The HTTPS server owns the process's signals: this one stops when told to.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def channel_server(
    channels: Channels, config: uvicorn.Config, limits: GatewayLimits
) -> ChannelServer:
    """The same options as the HTTPS server's, less TLS, for an app of the channels alone;
    the gateway's `limits` on heads and connections too (counted apart from the HTTPS
    server's): sandboxed replicas reach it through a socket file of their own."""
    return ChannelServer(
        uvicorn.Config(
            Starlette(routes=channels.routes()),
            log_level=config.log_level,
            access_log=False,
            lifespan="off",
            ws_ping_interval=config.ws_ping_interval,
            ws_max_size=config.ws_max_size,
            timeout_graceful_shutdown=config.timeout_graceful_shutdown,
            timeout_keep_alive=config.timeout_keep_alive,
            http=limited_protocol(limits),
        )
    )
