"""WebSocket channels: the long-lived links from worker agents and replicas."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

from starlette.websockets import WebSocket, WebSocketDisconnect

from ember_platform.auth import Scope, TokenRegistry
from ember_platform.cluster import RECORD_SEPARATOR, Cluster

POLICY_VIOLATION = 1008
MAX_BATCH = 64


async def _pump(websocket: WebSocket, outbox: asyncio.Queue[str], *, batch: bool) -> None:
    """Send queued messages in order; an empty string closes the channel.

    With `batch`, messages queued meanwhile share one frame (one TLS record, one system
    call), separated by RECORD_SEPARATOR.
    """
    while True:
        messages = [await outbox.get()]
        while batch and not outbox.empty() and len(messages) < MAX_BATCH:
            messages.append(outbox.get_nowait())
        closing = "" in messages
        messages = messages[: messages.index("")] if closing else messages
        if messages:
            await websocket.send_text(RECORD_SEPARATOR.join(messages))
        if closing:
            with contextlib.suppress(Exception):
                await websocket.close()
            return


class Channels:
    def __init__(self, cluster: Cluster, tokens: TokenRegistry) -> None:
        self.cluster = cluster
        self.tokens = tokens

    async def worker(self, websocket: WebSocket) -> None:
        scope = self.tokens.scope_of(websocket.headers.get("authorization"))
        if scope is None or not scope.allows(Scope.WORKER):
            await websocket.close(code=POLICY_VIOLATION)
            return
        await websocket.accept()
        try:
            hello = json.loads(await websocket.receive_text())
            worker = self.cluster.register_worker(hello)
        except (ValueError, KeyError, TypeError, WebSocketDisconnect):
            await websocket.close(code=POLICY_VIOLATION)
            return
        await websocket.send_text(json.dumps({"type": "welcome", "worker_id": worker.id}))
        pump = asyncio.ensure_future(_pump(websocket, worker.outbox, batch=False))
        try:
            while True:
                payload = json.loads(await websocket.receive_text())
                self.cluster.worker_message(worker, payload)
        except (WebSocketDisconnect, ValueError):
            pass
        finally:
            pump.cancel()
            self.cluster.worker_gone(worker, "disconnected")

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
        try:
            while True:
                for message in (await websocket.receive_text()).split(RECORD_SEPARATOR):
                    self.cluster.replica_message(replica, message)
        except (WebSocketDisconnect, ValueError, KeyError):
            pass
        finally:
            pump.cancel()
            self.cluster.replica_disconnected(replica)
