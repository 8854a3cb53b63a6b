"""An app's logs (`ember logs`): the lines kept, filtered, then (with `follow`) the new
ones as they come, as JSON lines, until the caller or the control plane stops."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember_platform.api.calls import done_unless_stopping
from ember_platform.api.workspaces import Tenancy
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.observability.logs import LogFilter


class LogsApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster, stopping: asyncio.Event) -> None:
        self.tenancy = tenancy
        self.cluster = cluster
        self.stopping = stopping  # set: a follow ends, as if the app said no more

    async def logs(self, request: Request) -> Response:
        named = request.path_params["app"]
        app = self.tenancy.app(request, named)
        follow = request.query_params.get("follow") in ("1", "true")
        try:
            tail = int(request.query_params.get("tail", "200"))
            since = request.query_params.get("since")
            wanted = LogFilter(
                endpoint=request.query_params.get("endpoint") or None,
                replica=request.query_params.get("replica") or None,
                call=request.query_params.get("call") or None,
                grep=request.query_params.get("grep") or None,
                trace=request.query_params.get("trace") or None,
                since=None if since is None else float(since),
            )
        except ValueError:
            raise HttpError(
                400, "invalid_request", "tail must be a whole number and since a Unix time"
            ) from None
        if tail < 0:
            raise HttpError(400, "invalid_request", "tail must not be negative")
        known = any(r.app == app for r in self.cluster.endpoints.values())
        logs = self.cluster.logs
        if not known and not logs.has_lines(app):
            raise HttpError(404, "not_found", f"no app named {named}")

        async def lines() -> AsyncIterator[bytes]:
            # The history is read and the follow begins with no await between them, as
            # the body starts: no line falls between the two.
            history = logs.tail(app, tail, wanted)
            queue = logs.follow(app) if follow else None
            getter: asyncio.Future[dict[str, Any]] | None = None
            try:
                for entry in history:
                    yield (json.dumps(entry) + "\n").encode()
                if queue is None:
                    return
                while True:
                    getter = getter or asyncio.ensure_future(queue.get())
                    if not await done_unless_stopping(getter, self.stopping, 15):
                        if self.stopping.is_set():
                            return  # the follower sees its stream end, not cut off
                        yield b"\n"  # keeps proxies from closing an idle stream
                        continue
                    entry = getter.result()
                    getter = None
                    if wanted.matches(entry):
                        yield (json.dumps(entry) + "\n").encode()
            finally:
                if getter is not None:
                    getter.cancel()
                if queue is not None:
                    logs.unfollow(app, queue)

        return StreamingResponse(lines(), media_type="application/x-ndjson")
