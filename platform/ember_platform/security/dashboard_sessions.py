"""The dashboard's sign-in: one-time login links and the sessions they open.

`ember dashboard` asks for a link with its token; the link's code works once, within a
minute, and opens a session: a random id the browser keeps in an HttpOnly cookie. A
session carries the grant of the token it came from (scope and workspace), ends at its
own deadline or that token's, whichever is first, and ends at once when that token is
revoked. Inside the control plane a session acts through an ephemeral bearer token of
that grant, which never leaves the process. Codes and ids are kept as hashes only.

Sessions are recorded in the state store (the hash of the id, the token's hash, the
deadline), so that one outlives the process that opened it: a process that owns the
platform next (or this one after a restart) finds a cookie's session there, with the
grant its token has now, and makes its own bearer for it. The store forgets a token's
sessions with the token. Links are not recorded: they last a minute.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from ember_platform.errors import Unauthorized
from ember_platform.security.tokens import (
    TOKEN_PREFIX,
    Grant,
    Scope,
    TokenRegistry,
    bearer_hash,
    hash_token,
)
from ember_platform.storage.state_store import StateStore

LINK_SECONDS = 60.0  # a login link is opened at once, or not at all
SESSION_SECONDS = 8 * 3600.0  # a working day; then sign in again
# Bounds on what unauthenticated visitors can make the control plane hold: only token
# holders make links and sessions, but a runaway script should not grow memory.
MAX_LINKS = 256
MAX_SESSIONS = 1024


@dataclass(frozen=True)
class _Link:
    grant: Grant
    token_hash: str
    expires_at: float


@dataclass(frozen=True)
class Session:
    grant: Grant
    token_hash: str  # of the token it came from: revoking that ends the session
    bearer: str  # the ephemeral token it acts through, inside the control plane only
    expires_at: float


class LinkRefused(Unauthorized):
    """A login link that is unknown, used already, or expired."""


class DashboardSessions:
    def __init__(
        self,
        tokens: TokenRegistry,
        store: StateStore,
        clock: Callable[[], float] = time.time,
        link_seconds: float = LINK_SECONDS,
        session_seconds: float = SESSION_SECONDS,
    ) -> None:
        self._tokens = tokens
        self._clock = clock
        self.link_seconds = link_seconds
        self.session_seconds = session_seconds
        self._links: dict[str, _Link] = {}  # hash of the code -> link
        self._sessions: dict[str, Session] = {}  # hash of the id -> session (this process's)
        self._store = store
        tokens.on_revoke(self._token_revoked)

    def _grant(self, authorization: str | None) -> tuple[Grant, str]:
        grant = self._tokens.require(authorization, Scope.DEPLOY)
        token_hash = bearer_hash(authorization)
        if token_hash is None:  # require() refused such a header already
            raise Unauthorized("missing or invalid token")
        return grant, token_hash

    def create_link(self, authorization: str | None) -> tuple[str, float]:
        """A one-time code for the bearer of `authorization` (a deploy or admin token), and
        when it expires."""
        grant, token_hash = self._grant(authorization)
        self._sweep()
        if len(self._links) >= MAX_LINKS:
            del self._links[next(iter(self._links))]  # the oldest
        code = secrets.token_urlsafe(32)
        expires_at = self._clock() + self.link_seconds
        self._links[hash_token(code)] = _Link(grant, token_hash, expires_at)
        return code, expires_at

    def redeem(self, code: str) -> tuple[str, Session]:
        """A new session for a link's code, which is spent: (its id, the session).
        LinkRefused for a code that is unknown, spent or expired."""
        link = self._links.pop(hash_token(code), None)
        if link is None:
            raise LinkRefused(
                "this login link is not valid: it was used already or never made; "
                "run `ember dashboard` for a new one"
            )
        if link.expires_at <= self._clock():
            raise LinkRefused(
                "this login link expired (links work for a minute); "
                "run `ember dashboard` for a new one"
            )
        return self._open(link.grant, link.token_hash)

    def sign_in(self, authorization: str | None) -> tuple[str, Session]:
        """A new session for a pasted token: (its id, the session)."""
        grant, token_hash = self._grant(authorization)
        return self._open(grant, token_hash)

    def _open(self, grant: Grant, token_hash: str) -> tuple[str, Session]:
        self._sweep()
        if len(self._sessions) >= MAX_SESSIONS:
            self._end(next(iter(self._sessions)))  # the oldest
        now = self._clock()
        expires_at = now + self.session_seconds
        if grant.expires_at is not None:
            expires_at = min(expires_at, grant.expires_at)
        session_id = secrets.token_urlsafe(32)
        key = hash_token(session_id)
        self._store.put_dashboard_session(key, token_hash, expires_at, now)
        return session_id, self._hold(key, grant, token_hash, expires_at)

    def _hold(self, key: str, grant: Grant, token_hash: str, expires_at: float) -> Session:
        """The session in this process, with a bearer of its own."""
        bearer = TOKEN_PREFIX + "session_" + secrets.token_urlsafe(32)
        session = Session(grant, token_hash, bearer, expires_at)
        self._tokens.add_ephemeral(bearer, grant.scope, grant.workspace)
        self._sessions[key] = session
        return session

    def session(self, session_id: str) -> Session | None:
        """The live session of a cookie's id; None if unknown, ended or expired."""
        key = hash_token(session_id)
        session = self._sessions.get(key) or self._recorded(key)
        if session is None:
            return None
        if session.expires_at <= self._clock():
            self._end(key)
            return None
        return session

    def _recorded(self, key: str) -> Session | None:
        """A session another process (or this one before a restart) opened, if its token
        still stands."""
        found = self._store.dashboard_session(key)
        if found is None:
            return None
        token_hash, expires_at = found
        grant = self._tokens.stored_grant(token_hash)
        if grant is None or expires_at <= self._clock():
            return None
        if len(self._sessions) >= MAX_SESSIONS:
            self._forget(next(iter(self._sessions)))  # the oldest held here; still recorded
        return self._hold(key, grant, token_hash, expires_at)

    def sign_out(self, session_id: str) -> None:
        self._end(hash_token(session_id))

    def __len__(self) -> int:
        return len(self._sessions)

    def _end(self, key: str) -> None:
        self._forget(key)
        self._store.delete_dashboard_sessions([key], ended_by=self._clock())

    def _forget(self, key: str) -> None:
        """Drop this process's hold of a session (its bearer), not its record."""
        session = self._sessions.pop(key, None)
        if session is not None:
            self._tokens.remove_ephemeral(session.bearer)

    def _token_revoked(self, token_hash: str) -> None:
        # The store forgot its sessions with the token.
        for key in [k for k, s in self._sessions.items() if s.token_hash == token_hash]:
            self._forget(key)
        for key in [k for k, link in self._links.items() if link.token_hash == token_hash]:
            del self._links[key]

    def _sweep(self) -> None:
        now = self._clock()
        for key in [k for k, link in self._links.items() if link.expires_at <= now]:
            del self._links[key]
        for key in [k for k, s in self._sessions.items() if s.expires_at <= now]:
            self._forget(key)
        self._store.delete_dashboard_sessions([], ended_by=now)  # every process's
