"""The dashboard's login links and sessions: one use, a minute, the token's grant."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember_platform.errors import Forbidden, Unauthorized
from ember_platform.security.dashboard_sessions import (
    LINK_SECONDS,
    DashboardSessions,
    LinkRefused,
)
from ember_platform.security.tokens import Scope, TokenRegistry, hash_token, token_id
from ember_platform.storage.sqlite_store import SqliteStateStore


class Clock:
    def __init__(self) -> None:
        self.now = time.time()  # tokens' expiry is in real time

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStateStore]:
    store = SqliteStateStore(tmp_path / "state.db")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def tokens(store: SqliteStateStore) -> TokenRegistry:
    return TokenRegistry(store)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sessions(tokens: TokenRegistry, store: SqliteStateStore, clock: Clock) -> DashboardSessions:
    return DashboardSessions(tokens, store, clock=clock, session_seconds=3600)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_link_opens_one_session_with_the_tokens_workspace_and_scope(
    tokens: TokenRegistry, sessions: DashboardSessions, clock: Clock
) -> None:
    token = tokens.create(Scope.DEPLOY, "team", workspace="team-a")
    code, expires_at = sessions.create_link(bearer(token))
    assert expires_at == clock.now + LINK_SECONDS and LINK_SECONDS <= 60
    assert token not in code and len(code) >= 40
    session_id, session = sessions.redeem(code)
    assert session.grant.scope is Scope.DEPLOY and session.grant.workspace == "team-a"
    assert sessions.session(session_id) == session
    # The session acts through its own ephemeral token, of the same scope and workspace.
    grant = tokens.grant_of(bearer(session.bearer))
    assert grant is not None and grant.scope is Scope.DEPLOY and grant.workspace == "team-a"
    with pytest.raises(LinkRefused, match="used already"):
        sessions.redeem(code)  # single use
    assert len(sessions) == 1


def test_a_wrong_or_expired_link_is_refused_as_401(
    tokens: TokenRegistry, sessions: DashboardSessions, clock: Clock
) -> None:
    code, _ = sessions.create_link(bearer(tokens.create(Scope.ADMIN, "op")))
    with pytest.raises(LinkRefused):
        sessions.redeem(code[:-1] + ("A" if code[-1] != "A" else "B"))
    with pytest.raises(LinkRefused):
        sessions.redeem("")
    clock.now += LINK_SECONDS
    with pytest.raises(LinkRefused, match="expired"):
        sessions.redeem(code)
    assert issubclass(LinkRefused, Unauthorized)  # answered 401
    with pytest.raises(LinkRefused, match="used already"):
        sessions.redeem(code)  # an expired code is gone too
    assert len(sessions) == 0


def test_links_need_a_deploy_or_admin_token(
    tokens: TokenRegistry, sessions: DashboardSessions
) -> None:
    with pytest.raises(Unauthorized):
        sessions.create_link(bearer("emb_nonsense"))
    with pytest.raises(Unauthorized):
        sessions.create_link(None)
    with pytest.raises(Forbidden):
        sessions.create_link(bearer(tokens.create(Scope.INVOKE, "caller")))
    with pytest.raises(Forbidden):
        sessions.sign_in(bearer(tokens.create(Scope.METRICS, "scraper")))


def test_a_session_ends_at_its_deadline_and_its_token_goes_with_it(
    tokens: TokenRegistry, sessions: DashboardSessions, clock: Clock
) -> None:
    session_id, session = sessions.sign_in(bearer(tokens.create(Scope.ADMIN, "op")))
    assert session.expires_at == clock.now + 3600
    clock.now += 3599
    assert sessions.session(session_id) is not None
    clock.now += 1
    assert sessions.session(session_id) is None
    assert tokens.grant_of(bearer(session.bearer)) is None
    assert sessions.session("not-an-id") is None


def test_a_session_ends_no_later_than_its_token_and_with_its_revocation(
    tokens: TokenRegistry, sessions: DashboardSessions, clock: Clock
) -> None:
    tokens.create(Scope.ADMIN, "kept")  # the last admin token cannot be revoked
    short = tokens.create(Scope.ADMIN, "short", expires_at=clock.now + 60)
    _, session = sessions.sign_in(bearer(short))
    assert session.expires_at == clock.now + 60
    code, _ = sessions.create_link(bearer(short))
    session_id, session = sessions.sign_in(bearer(short))
    tokens.revoke(token_id(hash_token(short)))
    assert sessions.session(session_id) is None
    assert tokens.grant_of(bearer(session.bearer)) is None
    with pytest.raises(LinkRefused):
        sessions.redeem(code)  # its links went too


def test_signing_out_ends_the_session(tokens: TokenRegistry, sessions: DashboardSessions) -> None:
    session_id, session = sessions.sign_in(bearer(tokens.create(Scope.DEPLOY, "me")))
    sessions.sign_out(session_id)
    assert sessions.session(session_id) is None
    assert tokens.grant_of(bearer(session.bearer)) is None
    sessions.sign_out(session_id)  # twice is fine


def test_a_session_outlives_the_process_that_opened_it(
    tokens: TokenRegistry, store: SqliteStateStore, sessions: DashboardSessions, clock: Clock
) -> None:
    """The next owner of the platform (a new registry over the same store) finds the
    cookie's session, with its token's grant, and a bearer of its own."""
    token = tokens.create(Scope.DEPLOY, "team", workspace="team-a")
    session_id, first = sessions.sign_in(bearer(token))
    next_owner = TokenRegistry(store)
    taken_over = DashboardSessions(next_owner, store, clock=clock, session_seconds=3600)
    found = taken_over.session(session_id)
    assert found is not None and found.expires_at == first.expires_at
    assert found.grant.scope is Scope.DEPLOY and found.grant.workspace == "team-a"
    assert found.bearer != first.bearer  # each process's own, never stored
    assert next_owner.grant_of(bearer(found.bearer)) is not None
    assert taken_over.session("not-an-id") is None
    # Signing out there ends it everywhere; so does the deadline.
    taken_over.sign_out(session_id)
    assert DashboardSessions(TokenRegistry(store), store, clock=clock).session(session_id) is None
    later_id, _ = sessions.sign_in(bearer(token))
    clock.now += 3600
    assert DashboardSessions(TokenRegistry(store), store, clock=clock).session(later_id) is None


def test_a_revoked_token_ends_its_sessions_for_the_next_owner_too(
    tokens: TokenRegistry, store: SqliteStateStore, sessions: DashboardSessions, clock: Clock
) -> None:
    tokens.create(Scope.ADMIN, "kept")  # the last admin token cannot be revoked
    token = tokens.create(Scope.ADMIN, "op")
    session_id, _ = sessions.sign_in(bearer(token))
    tokens.revoke(token_id(hash_token(token)))
    assert DashboardSessions(TokenRegistry(store), store, clock=clock).session(session_id) is None
