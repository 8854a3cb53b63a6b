"""The replicas themselves (`ember replica ls | stop | exec`, `ember profile`): list
them, stop one, run a command in one, or profile one with py-spy. A deploy token of the
replica's workspace may run commands in it (inside its sandbox, as its user: no more
than its own code may do); profiles are admin-only (py-spy reads the replica's memory
from outside its sandbox).

A command runs over HTTP (`POST .../exec`: its input, if any, in the request; its output
streamed back as JSON lines) or, when its caller types at it while it runs (`ember
replica exec -i` / `-t`), over a WebSocket at the same path: the first text message is
the request (`"interactive": true`, `"terminal": [rows, cols]` for a pseudo-terminal),
then binary messages are its input, `{"resize": [rows, cols]}` a new terminal size and
`{"eof": true}` the end of its input; the answer's messages are the same JSON events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ember.wire import messages as wire
from ember.wire.labels import split_app_key
from ember_platform.api.workspaces import Tenancy, in_listing, in_workspace
from ember_platform.core.cluster import Cluster
from ember_platform.core.replica_exec import (
    MAX_STDIN_BYTES,
    ExecEvent,
    ExecRequest,
    ExecSession,
    check_command,
    check_profile,
)
from ember_platform.edge.errors import HttpError
from ember_platform.runtime.cluster_model import Replica, ReplicaState
from ember_platform.security.tokens import Scope

# The command, and the standard input `ember replica exec -i` hands it, in base64.
MAX_EXEC_BODY_BYTES = MAX_STDIN_BYTES * 4 // 3 + 128 * 1024
POLICY_VIOLATION = 1008  # WebSocket close codes: a token that may not, a bad request
NOT_FOUND_CLOSE = 4404


def replica_row(cluster: Cluster, replica: Replica) -> dict[str, Any]:
    """What `ember replica ls` shows of one replica."""
    runtime = replica.endpoint
    worker = cluster.workers.get(replica.worker_id)
    start = replica.start
    canary = cluster.canaries.get(runtime.label)
    workspace, app = split_app_key(runtime.app)
    return {
        "id": replica.id,
        "workspace": workspace,
        "app": app,  # as named in its workspace, as `ember ls` names it
        "endpoint": runtime.spec.name,
        "label": runtime.label,
        "version": replica.version,
        "canary": canary is runtime,
        "node": worker.name if worker is not None else None,
        "state": replica.state.value,
        "running": len(replica.inflight),
        "served": replica.served,
        "created_at": replica.created_at,
        "ready_at": replica.ready_at,
        "start_kind": start.get("kind"),
        "start_seconds": start.get("total_seconds"),
        "memory_bytes": replica.memory_bytes,
        "cpu_throttled_seconds": replica.cpu_throttled_seconds,
        "gpu": f"{replica.gpu[0]}:{replica.gpu[1]}" if replica.gpu else None,
        "gang": None if replica.gang is None else replica.gang.id,
        "rank": replica.rank,
    }


def _may_exec(workspace: str | None, replica: Replica) -> bool:
    """Whether a token of `workspace` (None: an admin's, of every one) may run commands
    in `replica`."""
    return workspace is None or in_workspace(replica.endpoint.app, workspace)


def for_caller(event: ExecEvent) -> dict[str, Any]:
    """A worker's exec event as its caller gets it: `{"stream", "data"}` (base64, as the
    worker sent it), or at the end `{"exit_code"}` with an `"error"` if there was one."""
    if isinstance(event, wire.ExecOutput):
        return {"stream": event.stream, "data": event.data}
    end: dict[str, Any] = {"exit_code": event.exit_code}
    if event.error:
        end["error"] = event.error
    return end


class ReplicasApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster) -> None:
        self.tenancy = tenancy
        self.tokens = tenancy.tokens
        self.cluster = cluster

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/replicas", self.list_replicas, methods=["GET"]),
            Route("/v1/replicas/{replica_id}", self.stop_replica, methods=["DELETE"]),
            Route("/v1/replicas/{replica_id}/exec", self.exec_command, methods=["POST"]),
            Route("/v1/replicas/{replica_id}/profile", self.profile_replica, methods=["POST"]),
            WebSocketRoute("/v1/replicas/{replica_id}/exec", self.exec_session),
        ]

    def _replica(self, request: Request, needed: Scope = Scope.DEPLOY) -> Replica:
        """The replica the path names, if it is of the request's workspace."""
        _, workspace = self.tenancy.workspace(request, needed)
        replica_id = request.path_params["replica_id"]
        replica = self.cluster.replicas.get(replica_id)
        if replica is None or not in_workspace(replica.endpoint.app, workspace):
            raise HttpError(
                404, "not_found", f"no replica {replica_id} is running (`ember replica ls`)"
            )
        return replica

    async def list_replicas(self, request: Request) -> Response:
        """The replicas of the request's workspace (every one's for an admin's
        `?all_workspaces=true`), the oldest first; `?app=` keeps one app's."""
        _, workspace = self.tenancy.listed(request)
        named = request.query_params.get("app")
        app = None if named is None else self.tenancy.app(request, named)
        replicas = sorted(self.cluster.replicas.values(), key=lambda r: r.created_at)
        rows = [
            replica_row(self.cluster, r)
            for r in replicas
            if (app is None or r.endpoint.app == app) and in_listing(r.endpoint.app, workspace)
        ]
        return JSONResponse({"replicas": rows, "now": time.time()})

    async def stop_replica(self, request: Request) -> Response:
        """Drain it (it finishes what it runs, takes nothing new, then stops), or with
        `?now=1` kill it at once, its inputs going back to the queue. The autoscaler
        starts another where the load needs one."""
        replica = self._replica(request)
        runtime = replica.endpoint
        if request.query_params.get("now") in ("1", "true"):
            self.cluster.input_lifecycle.replica_lost(
                replica, "killed by an operator (ember replica stop --now)"
            )
            state = "killed"
        else:
            if replica.state in (ReplicaState.STARTING, ReplicaState.READY):
                self.cluster.logs.system(
                    runtime.app,
                    runtime.spec.name,
                    "replica draining: stopped by an operator (ember replica stop)",
                    replica.id,
                )
            self.cluster.replica_lifecycle.drain(replica)
            state = replica.state.value if replica.id in self.cluster.replicas else "stopped"
        self.cluster.wake.set()  # a replacement, if the load needs one
        return JSONResponse({"replica": replica.id, "state": state})

    async def exec_command(self, request: Request) -> Response:
        """Run a command beside the replica; the answer streams JSON lines as it runs:
        `{"stream": "stdout" | "stderr", "data": base64}` and, last,
        `{"exit_code": N}` or `{"exit_code": null, "error": "..."}`. A deploy token of
        the replica's workspace may: the command runs inside the replica's sandbox, as its
        user, with no more than the replica's own code has."""
        replica = self._replica(request)
        body = await request.body()
        if len(body) > MAX_EXEC_BODY_BYTES:
            raise HttpError(413, "body_too_large", "the command's standard input is at most 8 MiB")
        try:
            exec_request = check_command(json.loads(body or b"null"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        return self._run_beside(replica, exec_request)

    async def profile_replica(self, request: Request) -> Response:
        """Profile the replica with py-spy, run by its worker's agent against its process
        (`ember profile`). The body: `{"mode": "record" | "dump", "duration": S,
        "format": "flamegraph" | "speedscope", "native": true, "rate": N}`; the answer
        streams JSON lines as `exec`'s do: the flame graph, speedscope file or dump on
        stdout, py-spy's notes on stderr, then the exit. Admin only: it reads the
        replica's memory (its data, its secrets)."""
        replica = self._replica(request, Scope.ADMIN)
        body = await request.body()
        if len(body) > 4096:
            raise HttpError(413, "body_too_large", "a profile request is at most 4 KiB")
        try:
            exec_request = check_profile(json.loads(body or b"{}"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        if replica.state is not ReplicaState.READY:
            raise HttpError(
                409, "not_running", f"replica {replica.id} is {replica.state.value}, not ready"
            )
        return self._run_beside(replica, exec_request)

    def _run_beside(self, replica: Replica, exec_request: ExecRequest) -> Response:
        """Start the command (or profile) on the replica's worker; its events stream to
        the caller as JSON lines, and its start and end go into the app's log."""
        worker = self.cluster.workers.get(replica.worker_id)
        if worker is None:
            raise HttpError(409, "not_running", f"replica {replica.id} has no worker now")
        runtime = replica.endpoint
        command = " ".join(exec_request.command)[:200]
        session = self.cluster.execs.open(worker, replica.id, exec_request)
        what = "profile" if exec_request.profile is not None else "exec"
        self.cluster.logs.system(
            runtime.app, runtime.spec.name, f"{what} {session.id}: {command}", replica.id
        )

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    event = await session.next_event()
                    yield json.dumps(for_caller(event)).encode() + b"\n"
                    if isinstance(event, wire.ExecExit):
                        return
            finally:
                self.cluster.execs.close(session)
                self.cluster.logs.system(
                    runtime.app, runtime.spec.name, session.describe_end(), replica.id
                )

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def exec_session(self, websocket: WebSocket) -> None:
        """A command its caller types at while it runs (see the module's docstring)."""
        # Accepted, and its request read, before anything is checked: a refusal can then
        # say why (a handshake refused is a bare HTTP 403 to the client).
        await websocket.accept()
        try:
            body = json.loads(await websocket.receive_text())
        except (ValueError, KeyError):
            body = None
        except WebSocketDisconnect:
            return
        authorization = websocket.headers.get("authorization")
        grant = self.tokens.grant_of(authorization)
        replica_id = websocket.path_params["replica_id"]
        replica = self.cluster.replicas.get(replica_id)
        worker = self.cluster.workers.get(replica.worker_id) if replica is not None else None
        if grant is None or not grant.scope.allows(Scope.DEPLOY):
            why = (
                self.tokens.refusal(authorization)
                if grant is None
                else "this needs a deploy token of the replica's workspace, or an admin token"
            )
            await _refuse(websocket, POLICY_VIOLATION, why)
            return
        if replica is not None and not _may_exec(grant.workspace, replica):
            replica = None  # another workspace's: as if it did not exist
        if replica is None or worker is None:
            why = f"no replica {replica_id} is running (`ember replica ls`)"
            await _refuse(websocket, NOT_FOUND_CLOSE, why)
            return
        try:
            exec_request = check_command(body)
        except ValueError as exc:
            await _refuse(websocket, POLICY_VIOLATION, str(exc))
            return
        runtime = replica.endpoint
        command = " ".join(exec_request.command)[:200]
        session = self.cluster.execs.open(worker, replica.id, exec_request)
        self.cluster.logs.system(
            runtime.app, runtime.spec.name, f"exec {session.id}: {command}", replica.id
        )
        from_caller = asyncio.ensure_future(_caller_input(websocket, session))
        try:
            await _to_caller(websocket, session, from_caller)
        finally:
            from_caller.cancel()
            self.cluster.execs.close(session)
            self.cluster.logs.system(
                runtime.app, runtime.spec.name, session.describe_end(), replica.id
            )


async def _refuse(websocket: WebSocket, code: int, why: str) -> None:
    """Say why the command cannot run, as its end, and close."""
    with contextlib.suppress(Exception):
        await websocket.send_text(json.dumps({"exit_code": None, "error": why}))
        await websocket.close(code)


async def _caller_input(websocket: WebSocket, session: ExecSession) -> None:
    """The caller's input, terminal sizes and end of input, until it hangs up."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("bytes") is not None:
            session.send_input(message["bytes"])
            continue
        with contextlib.suppress(ValueError, TypeError):
            control = json.loads(message.get("text") or "null")
            if isinstance(control, dict) and control.get("eof"):
                session.end_input()
            elif isinstance(control, dict) and isinstance(control.get("resize"), list):
                rows, cols = (int(n) for n in control["resize"][:2])
                session.resize(max(1, min(rows, 1000)), max(1, min(cols, 1000)))


async def _to_caller(
    websocket: WebSocket, session: ExecSession, from_caller: asyncio.Future[None]
) -> None:
    """The command's output and end; returns early when its caller hangs up."""
    while True:
        event_task = asyncio.ensure_future(session.next_event())
        waiting: set[asyncio.Future[Any]] = {event_task, from_caller}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not event_task.done():  # the caller left: the command is killed
            event_task.cancel()
            return
        event = event_task.result()
        await websocket.send_text(json.dumps(for_caller(event)))
        if isinstance(event, wire.ExecExit):
            await websocket.close()
            return
