"""API tokens (by hash, never the token) and secrets (their values)."""

from __future__ import annotations

import json

from ember_platform.storage.records import SecretRecord, TokenRecord
from ember_platform.storage.sqlite.database import Database


class CredentialTables:
    """The tokens and secrets tables."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_token(self, token: TokenRecord) -> None:
        self._db.write(
            "INSERT INTO tokens (token_hash, scope, name, created_at, app, rate_limit, "
            "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                token.token_hash,
                token.scope,
                token.name,
                token.created_at,
                token.app,
                token.rate_limit,
                token.expires_at,
            ),
        )

    def list_tokens(self) -> list[TokenRecord]:
        rows = self._db.execute(
            "SELECT token_hash, scope, name, created_at, app, rate_limit, expires_at FROM tokens"
        )
        return [TokenRecord(*row) for row in rows]

    def put_secret(self, secret: SecretRecord) -> None:
        self._db.write(
            "INSERT OR REPLACE INTO secrets VALUES (?, ?, ?)",
            (secret.name, json.dumps(secret.values), secret.updated_at),
        )

    def list_secrets(self) -> list[SecretRecord]:
        rows = self._db.execute("SELECT name, secret_values, updated_at FROM secrets")
        return [SecretRecord(name, json.loads(values), at) for name, values, at in rows]

    def delete_secret(self, name: str) -> bool:
        return self._db.write("DELETE FROM secrets WHERE name = ?", (name,)).rowcount > 0

    def delete_token(self, token_hash: str) -> bool:
        cursor = self._db.write("DELETE FROM tokens WHERE token_hash = ?", (token_hash,))
        return cursor.rowcount > 0
