"""Bearer tokens: created once, shown once, stored as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from ember.wire.labels import MAIN_WORKSPACE, split_app_key
from ember_platform.errors import Forbidden, Unauthorized
from ember_platform.security.rate_limits import RateLimit, parse_rate_limit
from ember_platform.storage.records import TokenRecord
from ember_platform.storage.state_store import StateStore

TOKEN_PREFIX = "emb_"


class Scope(StrEnum):
    ADMIN = "admin"  # the platform operator's: every workspace, workspaces, nodes
    DEPLOY = "deploy"  # everything inside its workspace: deploy, logs, secrets, calls
    INVOKE = "invoke"  # call endpoints and read async results
    WORKER = "worker"  # join as a worker node, fetch bundles
    METRICS = "metrics"  # read /metrics (a Prometheus scraper)

    def allows(self, needed: Scope) -> bool:
        if self is Scope.DEPLOY:
            return needed in (Scope.DEPLOY, Scope.INVOKE)
        return self is Scope.ADMIN or self is needed


# Tokens that act inside one workspace; the others (admin, worker, metrics) are the
# platform's and reach every workspace.
WORKSPACE_SCOPES = frozenset({Scope.DEPLOY, Scope.INVOKE})


MAX_TOKEN_NAME = 100


def checked_token_name(name: object) -> str:
    """A token's name as asked for (None: none); ValueError for one that is not text, is
    too long, or holds control characters (`ember token ls` prints names as they are)."""
    if name is None:
        return ""
    if not isinstance(name, str):
        raise ValueError(f"a token's name is text, not {name!r}")
    if len(name) > MAX_TOKEN_NAME:
        raise ValueError(f"a token's name has at most {MAX_TOKEN_NAME} characters, not {len(name)}")
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        raise ValueError(f"a token's name may not hold control characters: {name!r}")
    return name


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


TOKEN_ID_LENGTH = 12  # hex digits of the hash: a token's public name


def token_id(token_hash: str) -> str:
    return token_hash[:TOKEN_ID_LENGTH]


@dataclass(frozen=True)
class Grant:
    """What a token may do: its scope, its workspace, and for an invoke token maybe one
    app only."""

    scope: Scope
    app: str | None = None  # an app key (`workspace--app` outside main)
    rate_limit: RateLimit | None = None  # calls it may make; None: no limit
    expires_at: float | None = None  # Unix time it stops working at; None: never
    workspace: str | None = None  # None: every workspace (the platform's own tokens)

    def may_call(self, app: str) -> bool:
        """Whether it may reach the app whose key is `app`."""
        if self.workspace is not None and split_app_key(app)[0] != self.workspace:
            return False
        return self.app is None or self.app == app

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class NoSuchTokenError(LookupError):
    """No stored token has that id."""


class LastAdminTokenError(ValueError):
    """Revoking it would leave no admin token: nobody could manage the platform."""


class TokenRegistry:
    """Looks tokens up by hash in memory; the store is written on every change."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._records = {t.token_hash: t for t in store.list_tokens()}
        self._grants = {h: _grant(t) for h, t in self._records.items()}
        self._revoke_listeners: list[Callable[[str], None]] = []

    def create(
        self,
        scope: Scope,
        name: str,
        app: str | None = None,
        rate_limit: RateLimit | None = None,
        expires_at: float | None = None,
        workspace: str | None = None,
    ) -> str:
        """A new token (stored only as its hash; `token_id(hash_token(token))` names it).
        A deploy or invoke token acts in `workspace` (main if None) only; with `app` (an
        app key), an invoke token calls that app's endpoints only; with `rate_limit`, its
        calls are limited to that rate; with `expires_at`, it stops working then."""
        if app is not None and scope is not Scope.INVOKE:
            raise ValueError(f"only invoke tokens are for one app, not {scope.value} tokens")
        if rate_limit is not None and scope not in (Scope.INVOKE, Scope.DEPLOY, Scope.ADMIN):
            raise ValueError(f"a {scope.value} token makes no calls to limit")
        if scope in WORKSPACE_SCOPES:
            workspace = workspace or MAIN_WORKSPACE
            if app is not None and split_app_key(app)[0] != workspace:
                raise ValueError(f"app {app} is not of workspace {workspace}")
        elif workspace is not None:
            raise ValueError(f"a {scope.value} token is the platform's, of no one workspace")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        limit = None if rate_limit is None else str(rate_limit)
        record = TokenRecord(
            hash_token(token), scope.value, name, time.time(), app, limit, expires_at, workspace
        )
        self._store.add_token(record)
        self._records[record.token_hash] = record
        self._grants[record.token_hash] = _grant(record)
        return token

    def stored(self) -> list[TokenRecord]:
        """The tokens made with `create`, oldest first."""
        return sorted(self._records.values(), key=lambda t: t.created_at)

    def revoke(self, wanted_id: str) -> TokenRecord:
        """Forget the stored token whose id is `wanted_id`, at once: requests with it get
        401 and channels opened with it are closed (`on_revoke`)."""
        record = next(
            (t for t in self._records.values() if token_id(t.token_hash) == wanted_id), None
        )
        if record is None:
            raise NoSuchTokenError(wanted_id)
        # Tokens that expire do not count: once they have, nobody could manage the platform.
        lasting = [
            t
            for t in self._records.values()
            if t.scope == Scope.ADMIN.value and t.expires_at is None
        ]
        if record.scope == Scope.ADMIN.value and lasting == [record]:
            raise LastAdminTokenError(wanted_id)
        self._store.delete_token(record.token_hash)  # first: a refused write changes nothing
        del self._records[record.token_hash]
        self._grants.pop(record.token_hash, None)
        for listener in self._revoke_listeners:
            listener(record.token_hash)
        return record

    def on_revoke(self, listener: Callable[[str], None]) -> None:
        """Call `listener(token_hash)` whenever a token is revoked."""
        self._revoke_listeners.append(listener)

    def add_ephemeral(self, token: str, scope: Scope, workspace: str | None = None) -> None:
        """Accept a token for this process's lifetime only (replica credentials): of
        `workspace` only, if one is named."""
        self._grants[hash_token(token)] = Grant(scope, workspace=workspace)

    def remove_ephemeral(self, token: str) -> None:
        self._grants.pop(hash_token(token), None)

    def stored_grant(self, token_hash: str) -> Grant | None:
        """The grant of a stored token, by its hash; None if there is none, or it expired."""
        if token_hash not in self._records:
            return None
        grant = self._grants[token_hash]
        return None if grant.expired(time.time()) else grant

    def grant_of(self, authorization: str | None) -> Grant | None:
        """What the bearer token in an Authorization header may do; None if unknown or
        expired."""
        grant = self._known(authorization)
        return None if grant is None or grant.expired(time.time()) else grant

    def _known(self, authorization: str | None) -> Grant | None:
        token_hash = bearer_hash(authorization)
        # Looking up the hash, not the token, leaks nothing useful through timing.
        return None if token_hash is None else self._grants.get(token_hash)

    def refusal(self, authorization: str | None, unknown: str = "missing or invalid token") -> str:
        """Why the header's token gets no grant, for its 401: when it expired, else
        `unknown`."""
        grant = self._known(authorization)
        if grant is not None and grant.expires_at is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(grant.expires_at))
            return f"the token expired at {when}; create another with `ember token create`"
        return unknown

    def require(self, authorization: str | None, needed: Scope) -> Grant:
        """The grant of the header's token, if it allows `needed`: else Unauthorized (no
        such token, or an expired one) or Forbidden (a token that may not)."""
        grant = self.grant_of(authorization)
        if grant is None:
            raise Unauthorized(self.refusal(authorization))
        if not grant.scope.allows(needed):
            if needed is Scope.DEPLOY:
                raise Forbidden("this needs a deploy token (of its workspace) or an admin token")
            article = "an" if needed.value[0] in "aeiou" else "a"
            raise Forbidden(f"this needs {article} {needed.value} token")
        return grant

    def scope_of(self, authorization: str | None) -> Scope | None:
        """The scope of the bearer token in an Authorization header; None if unknown."""
        grant = self.grant_of(authorization)
        return None if grant is None else grant.scope

    def __len__(self) -> int:
        return len(self._grants)


def _grant(record: TokenRecord) -> Grant:
    limit = None if record.rate_limit is None else parse_rate_limit(record.rate_limit)
    scope = Scope(record.scope)
    # Invoke tokens made before workspaces were main's: the only one there was.
    workspace = record.workspace
    if workspace is None and scope in WORKSPACE_SCOPES:
        workspace = MAIN_WORKSPACE
    return Grant(scope, record.app, limit, record.expires_at, workspace)


def bearer_hash(authorization: str | None) -> str | None:
    """The hash of the bearer token in an Authorization header, if it has one."""
    if not authorization:
        return None
    kind, _, token = authorization.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return None
    return hash_token(token.strip())
