"""`GET /dashboard/api/v1/...`: the page's reads of the API, made with its session.

The browser sends the session cookie to `/dashboard` paths only; here the request is
passed on to the API as `/v1/...` with the session's ephemeral bearer token in place of
the cookie. Only reads the page makes pass: nothing a session does can change anything.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ember_platform.edge.asgi_types import Receive, Send
from ember_platform.edge.errors import error_body
from ember_platform.http.dashboard.page import DASHBOARD_PATH
from ember_platform.http.dashboard.signin import not_signed_in, session_id_of
from ember_platform.security.dashboard_sessions import DashboardSessions

API_PREFIX = DASHBOARD_PATH + "/api"
# What the page reads: the tables, the workspaces, the history, an app's logs.
READS = re.compile(r"/v1/(apps|replicas|snapshots|workspaces|dashboard/history|apps/[^/]+/logs)")
# Starlette's routing state of the outer request, set afresh for the inner one.
ROUTING_KEYS = ("route", "endpoint", "path_params", "router")


class SessionProxy:
    """An ASGI app, routed at `/dashboard/api/{path}`, that calls the API it is part of."""

    def __init__(self, sessions: DashboardSessions) -> None:
        self.sessions = sessions

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope["path"].removeprefix(API_PREFIX)
        if scope["method"] != "GET" or not READS.fullmatch(path):
            body = error_body("not_found", f"{scope['path']}: the dashboard reads no such path")
            await Response(body, 404, media_type="application/json")(scope, receive, send)
            return
        session_id = session_id_of(Request(scope))
        session = None if session_id is None else self.sessions.session(session_id)
        if session is None:
            await not_signed_in()(scope, receive, send)
            return
        headers = [
            (name, value)
            for name, value in scope["headers"]
            if name not in (b"authorization", b"cookie")
        ]
        headers.append((b"authorization", b"Bearer " + session.bearer.encode()))
        inner = {k: v for k, v in scope.items() if k not in ROUTING_KEYS}
        inner.update(path=path, raw_path=path.encode(), headers=headers)
        await scope["app"](inner, receive, send)
