"""The dashboard's sign-in over HTTP: login links, the session cookie, signing out.

- `POST /v1/dashboard/links` (a deploy or admin token): a one-time login link.
- `GET /dashboard/login?code=...`: spends the code, sets the session cookie and sends the
  browser on to `/dashboard`, so the code is in no URL the page keeps.
- `POST /dashboard/session` (a pasted token in Authorization): the same cookie.
- `GET /dashboard/session`: who the cookie's session is; `DELETE`: sign out.

The cookie is HttpOnly (no script reads it), Secure, SameSite=Strict (no other site's page
sends it) and for `/dashboard` paths only: the same host serves users' web apps, which must
never see it.
"""

from __future__ import annotations

import html
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from ember_platform.edge.errors import error_body
from ember_platform.errors import Unauthorized
from ember_platform.http.dashboard.page import DASHBOARD_PATH, page_headers
from ember_platform.security.dashboard_sessions import DashboardSessions, LinkRefused, Session

COOKIE = "ember_dashboard"
COOKIE_PATH = DASHBOARD_PATH
LOGIN_PATH = DASHBOARD_PATH + "/login"
SESSION_PATH = DASHBOARD_PATH + "/session"
NOT_SIGNED_IN = (
    "not signed in, or the session ended: run `ember dashboard` for a login link, or paste "
    "a deploy or admin token"
)


def session_id_of(request: Request) -> str | None:
    return request.cookies.get(COOKIE) or None


def _set_cookie(response: Response, session_id: str, session: Session) -> None:
    response.set_cookie(
        COOKIE,
        session_id,
        max_age=max(1, int(session.expires_at - time.time())),
        path=COOKIE_PATH,
        secure=True,
        httponly=True,
        samesite="strict",
    )


def _about(session: Session) -> dict[str, object]:
    return {
        "scope": session.grant.scope.value,
        "workspace": session.grant.workspace,
        "expires_at": session.expires_at,
    }


def _refusal_page(message: str) -> Response:
    body = (
        '<!doctype html><meta charset="utf-8"><title>Ember: sign-in refused</title>'
        f"<h1>Sign-in refused</h1><p>{html.escape(message)}</p>"
        f'<p><a href="{DASHBOARD_PATH}">Open the dashboard</a> to paste a token instead.</p>'
    )
    policy = "default-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    return Response(body, 401, headers=page_headers(policy), media_type="text/html")


class SignIn:
    def __init__(self, sessions: DashboardSessions) -> None:
        self.sessions = sessions

    async def create_link(self, request: Request) -> Response:
        code, expires_at = self.sessions.create_link(request.headers.get("authorization"))
        path = f"{LOGIN_PATH}?code={code}"
        url = str(request.base_url).rstrip("/") + path
        return JSONResponse({"path": path, "url": url, "expires_at": expires_at}, 201)

    async def login(self, request: Request) -> Response:
        try:
            session_id, session = self.sessions.redeem(request.query_params.get("code", ""))
        except LinkRefused as exc:
            return _refusal_page(exc.message)
        self._replaced(request)
        response = RedirectResponse(DASHBOARD_PATH, status_code=303)
        response.headers["Referrer-Policy"] = "no-referrer"  # the code stays here
        response.headers["Cache-Control"] = "no-store"
        _set_cookie(response, session_id, session)
        return response

    async def sign_in(self, request: Request) -> Response:
        session_id, session = self.sessions.sign_in(request.headers.get("authorization"))
        self._replaced(request)
        response = JSONResponse(_about(session))
        _set_cookie(response, session_id, session)
        return response

    def _replaced(self, request: Request) -> None:
        """A new session ends the one this browser had, rather than leave it to expire."""
        old = session_id_of(request)
        if old is not None:
            self.sessions.sign_out(old)

    async def whoami(self, request: Request) -> Response:
        session_id = session_id_of(request)
        session = None if session_id is None else self.sessions.session(session_id)
        if session is None:
            raise Unauthorized(NOT_SIGNED_IN)
        return JSONResponse(_about(session))

    async def sign_out(self, request: Request) -> Response:
        session_id = session_id_of(request)
        if session_id is not None:
            self.sessions.sign_out(session_id)
        response = Response(status_code=204)
        response.delete_cookie(
            COOKIE, path=COOKIE_PATH, secure=True, httponly=True, samesite="strict"
        )
        return response


def not_signed_in() -> Response:
    return Response(error_body("unauthorized", NOT_SIGNED_IN), 401, media_type="application/json")
