"""Bearer tokens: created once, shown once, stored as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
import time
from enum import StrEnum

from ember_platform.records import TokenRecord
from ember_platform.store import StateStore

TOKEN_PREFIX = "emb_"


class Scope(StrEnum):
    ADMIN = "admin"  # everything: deploy, stop, tokens, invoke
    INVOKE = "invoke"  # call endpoints and read async results
    WORKER = "worker"  # join as a worker node, fetch bundles
    METRICS = "metrics"  # read /metrics (a Prometheus scraper)

    def allows(self, needed: Scope) -> bool:
        return self is Scope.ADMIN or self is needed


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenRegistry:
    """Looks tokens up by hash in memory; the store is written on every change."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._scopes = {t.token_hash: Scope(t.scope) for t in store.list_tokens()}

    def create(self, scope: Scope, name: str) -> str:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        record = TokenRecord(hash_token(token), scope.value, name, time.time())
        self._store.add_token(record)
        self._scopes[record.token_hash] = scope
        return token

    def add_ephemeral(self, token: str, scope: Scope) -> None:
        """Accept a token for this process's lifetime only (replica credentials)."""
        self._scopes[hash_token(token)] = scope

    def remove_ephemeral(self, token: str) -> None:
        self._scopes.pop(hash_token(token), None)

    def scope_of(self, authorization: str | None) -> Scope | None:
        """The scope of the bearer token in an Authorization header; None if unknown."""
        if not authorization:
            return None
        kind, _, token = authorization.partition(" ")
        if kind.lower() != "bearer" or not token:
            return None
        # Looking up the hash, not the token, leaks nothing useful through timing.
        return self._scopes.get(hash_token(token.strip()))

    def __len__(self) -> int:
        return len(self._scopes)
