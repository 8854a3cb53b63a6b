"""API tokens (by hash, never the token), the dashboard's sessions (by hash, never the
cookie's id), secrets (their values), workspaces and their admission limits."""

from __future__ import annotations

import json

from ember_platform.storage.records import (
    SecretRecord,
    TokenRecord,
    WorkspaceLimitsRecord,
    WorkspaceRecord,
)
from ember_platform.storage.tables.database import Database, upsert

PUT_SECRET = upsert("secrets", ("name", "secret_values", "updated_at"), ("name",))
LIMIT_COLUMNS = ("workspace", "max_queued", "max_running", "rate", "updated_at")
PUT_LIMITS = upsert("workspace_limits", LIMIT_COLUMNS, ("workspace",))


class CredentialTables:
    """The tokens, dashboard_sessions, secrets, workspaces and workspace_limits tables."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_token(self, token: TokenRecord) -> None:
        self._db.write(
            "INSERT INTO tokens (token_hash, scope, name, created_at, app, rate_limit, "
            "expires_at, workspace) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                token.token_hash,
                token.scope,
                token.name,
                token.created_at,
                token.app,
                token.rate_limit,
                token.expires_at,
                token.workspace,
            ),
        )

    def list_tokens(self) -> list[TokenRecord]:
        rows = self._db.execute(
            "SELECT token_hash, scope, name, created_at, app, rate_limit, expires_at, "
            "workspace FROM tokens"
        )
        return [TokenRecord(*row) for row in rows]

    def put_workspace(self, workspace: WorkspaceRecord) -> None:
        self._db.write(
            "INSERT INTO workspaces (name, created_at) VALUES (?, ?)",
            (workspace.name, workspace.created_at),
        )

    def list_workspaces(self) -> list[WorkspaceRecord]:
        rows = self._db.execute("SELECT name, created_at FROM workspaces")
        return [WorkspaceRecord(*row) for row in rows]

    def put_workspace_limits(self, limits: WorkspaceLimitsRecord) -> None:
        """Record a workspace's limits; all of them defaults, its row goes."""
        if limits.empty:
            self._db.write("DELETE FROM workspace_limits WHERE workspace = ?", (limits.workspace,))
            return
        self._db.write(
            PUT_LIMITS,
            (
                limits.workspace,
                limits.max_queued,
                limits.max_running,
                limits.rate,
                limits.updated_at,
            ),
        )

    def list_workspace_limits(self) -> list[WorkspaceLimitsRecord]:
        rows = self._db.execute(f"SELECT {', '.join(LIMIT_COLUMNS)} FROM workspace_limits")
        return [WorkspaceLimitsRecord(*row) for row in rows]

    def delete_workspace(self, name: str) -> bool:
        """Forget a workspace and everything it held: rows keyed by its apps' keys
        (`name--app`; main's keys hold no `--`), by its labels (`name--app--endpoint`) and
        its secrets and tokens. A workspace made later with the name starts empty."""
        if not self._db.execute("SELECT 1 FROM workspaces WHERE name = ?", (name,)).fetchone():
            return False
        keys = f"{name}--%"  # names are [a-z0-9-]: no LIKE wildcard in them
        labels = f"{name}--%--%"
        by_key = (
            "deployments",
            "scaling_overrides",
            "endpoint_starts",
            "replica_usage",
            "token_usage",
            "dict_items",
            "queue_items",
            "volume_files",
        )
        statements: list[tuple[str, tuple[object, ...]]] = [
            (f"DELETE FROM {table} WHERE app LIKE ?", (keys,)) for table in by_key
        ]
        statements += [
            ("DELETE FROM calls WHERE label LIKE ?", (labels,)),
            ("DELETE FROM snapshots WHERE label LIKE ?", (labels,)),
            ("DELETE FROM openai_files WHERE label LIKE ?", (labels,)),
            ("DELETE FROM openai_batches WHERE label LIKE ?", (labels,)),
            ("DELETE FROM secrets WHERE name LIKE ?", (keys,)),
            (
                "DELETE FROM dashboard_sessions WHERE token_hash IN "
                "(SELECT token_hash FROM tokens WHERE workspace = ?)",
                (name,),
            ),
            ("DELETE FROM tokens WHERE workspace = ?", (name,)),
            ("DELETE FROM workspace_limits WHERE workspace = ?", (name,)),
            ("DELETE FROM workspaces WHERE name = ?", (name,)),
        ]
        self._db.write_each(statements)
        return True

    def put_secret(self, secret: SecretRecord) -> None:
        self._db.write(
            PUT_SECRET,
            (secret.name, json.dumps(secret.values), secret.updated_at),
        )

    def list_secrets(self) -> list[SecretRecord]:
        rows = self._db.execute("SELECT name, secret_values, updated_at FROM secrets")
        return [SecretRecord(name, json.loads(values), at) for name, values, at in rows]

    def delete_secret(self, name: str) -> bool:
        return self._db.write("DELETE FROM secrets WHERE name = ?", (name,)).rowcount > 0

    def delete_token(self, token_hash: str) -> bool:
        found = self._db.execute("SELECT 1 FROM tokens WHERE token_hash = ?", (token_hash,))
        if not found.fetchone():
            return False
        self._db.write_each(
            [  # its sessions go with it
                ("DELETE FROM dashboard_sessions WHERE token_hash = ?", (token_hash,)),
                ("DELETE FROM tokens WHERE token_hash = ?", (token_hash,)),
            ]
        )
        return True

    def put_dashboard_session(
        self, session_hash: str, token_hash: str, expires_at: float, created_at: float
    ) -> None:
        self._db.write(
            "INSERT INTO dashboard_sessions (session_hash, token_hash, expires_at, created_at) "
            "VALUES (?, ?, ?, ?)",
            (session_hash, token_hash, expires_at, created_at),
        )

    def dashboard_session(self, session_hash: str) -> tuple[str, float] | None:
        """(the hash of its token, when it ends) of a stored session, or None."""
        row = self._db.execute(
            "SELECT token_hash, expires_at FROM dashboard_sessions WHERE session_hash = ?",
            (session_hash,),
        ).fetchone()
        return None if row is None else (str(row[0]), float(row[1]))

    def delete_dashboard_sessions(self, session_hashes: list[str], ended_by: float) -> None:
        """Forget these sessions, and every one that ended by `ended_by`."""
        statements: list[tuple[str, tuple[object, ...]]] = [
            ("DELETE FROM dashboard_sessions WHERE session_hash = ?", (key,))
            for key in session_hashes
        ]
        statements.append(("DELETE FROM dashboard_sessions WHERE expires_at <= ?", (ended_by,)))
        self._db.write_each(statements)
