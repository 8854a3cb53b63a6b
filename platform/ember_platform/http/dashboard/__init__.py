"""The dashboard: its page (`page.py`), its sign-in (`signin.py`), the session's reads of
the API (`proxy.py`) and the endpoints' history (`history_api.py`)."""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from ember_platform.api.workspaces import Tenancy
from ember_platform.http.dashboard.history_api import HistoryApi
from ember_platform.http.dashboard.page import DASHBOARD_PATH, dashboard
from ember_platform.http.dashboard.proxy import API_PREFIX, SessionProxy
from ember_platform.http.dashboard.signin import LOGIN_PATH, SESSION_PATH, SignIn
from ember_platform.observability.history import MetricsHistory
from ember_platform.security.dashboard_sessions import DashboardSessions
from ember_platform.storage.state_store import StateStore


def is_dashboard_path(path: str) -> bool:
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


class Dashboard:
    def __init__(self, tenancy: Tenancy, history: MetricsHistory, store: StateStore) -> None:
        self.sessions = DashboardSessions(tenancy.tokens, store)
        self.signin = SignIn(self.sessions)
        self.history = HistoryApi(tenancy, history)
        self.proxy = SessionProxy(self.sessions)

    def routes(self) -> list[BaseRoute]:
        signin = self.signin
        return [
            Route(DASHBOARD_PATH, dashboard, methods=["GET"]),
            Route(LOGIN_PATH, signin.login, methods=["GET"]),
            Route(SESSION_PATH, signin.whoami, methods=["GET"]),
            Route(SESSION_PATH, signin.sign_in, methods=["POST"]),
            Route(SESSION_PATH, signin.sign_out, methods=["DELETE"]),
            Route(API_PREFIX + "/{path:path}", self.proxy, methods=["GET"]),
            Route("/v1/dashboard/links", signin.create_link, methods=["POST"]),
            Route("/v1/dashboard/history", self.history.history_of, methods=["GET"]),
        ]
