"""SQLite state store (WAL): the embedded default for one control-plane process."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from ember.wire.labels import make_label
from ember_platform.storage.records import (
    WEBHOOK_PENDING,
    CallRecord,
    CallStatus,
    Deployment,
    ReplicaUsage,
    ScalingOverride,
    SecretRecord,
    SnapshotRecord,
    TokenRecord,
    VolumeFile,
)
from ember_platform.storage.state_store import StoreWriteError

SCHEMA = """
CREATE TABLE IF NOT EXISTS deployments (
    app TEXT NOT NULL,
    version INTEGER NOT NULL,
    bundle_digest TEXT NOT NULL,
    manifest TEXT NOT NULL,
    created_at REAL NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0,
    canary_percent INTEGER,
    withdrawn INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (app, version)
);
CREATE TABLE IF NOT EXISTS tokens (
    token_hash TEXT PRIMARY KEY,
    scope TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    app TEXT
);
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT PRIMARY KEY,
    secret_values TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    id TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    method TEXT NOT NULL,
    body BLOB NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    http_status INTEGER,
    result BLOB,
    media_type TEXT,
    filename TEXT,
    webhook TEXT,
    webhook_state TEXT
);
CREATE TABLE IF NOT EXISTS replica_usage (
    replica_id TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    gpu_type TEXT,
    gpu_count INTEGER NOT NULL,
    cpu REAL NOT NULL,
    memory_mib INTEGER NOT NULL,
    start_kind TEXT,
    inputs INTEGER NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS replica_usage_ended ON replica_usage (ended_at);
CREATE TABLE IF NOT EXISTS snapshots (
    key TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    bundle_digest TEXT NOT NULL,
    env_key TEXT NOT NULL,
    size INTEGER NOT NULL,
    raw_size INTEGER NOT NULL,
    dump_seconds REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS scaling_overrides (
    label TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    version INTEGER NOT NULL,
    settings TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS draining_nodes (
    name TEXT PRIMARY KEY,
    since REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS dict_items (
    app TEXT NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    expires_at REAL,
    PRIMARY KEY (app, name, key)
);
CREATE TABLE IF NOT EXISTS queue_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    app TEXT NOT NULL,
    name TEXT NOT NULL,
    value BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS queue_items_by_queue ON queue_items (app, name, seq);
CREATE TABLE IF NOT EXISTS volume_files (
    app TEXT NOT NULL,
    volume TEXT NOT NULL,
    path TEXT NOT NULL,
    digest TEXT NOT NULL,
    size INTEGER NOT NULL,
    modified REAL NOT NULL,
    PRIMARY KEY (app, volume, path)
);
CREATE INDEX IF NOT EXISTS volume_files_by_digest ON volume_files (digest);
CREATE TABLE IF NOT EXISTS blob_deletes (
    key TEXT PRIMARY KEY,
    failed_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_unfinished ON calls (status) WHERE status IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS calls_created ON calls (created_at);
"""


SNAPSHOT_COLUMNS = (
    "key, label, bundle_digest, env_key, size, raw_size, dump_seconds, created_at, image_id, "
    "restores, last_restored_at, last_restore_seconds"
)
DEPLOYMENT_COLUMNS = "app, version, bundle_digest, manifest, created_at, canary_percent, withdrawn"
# A version that serves its endpoints' calls (not a canary, not withdrawn or stopped).
SERVES = "stopped = 0 AND withdrawn = 0 AND canary_percent IS NULL"


def _deployment(row: tuple) -> Deployment:
    return Deployment(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5], bool(row[6]))


class SqliteStateStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)  # secrets' values and async calls' arguments are in it
        path.chmod(0o600)
        # One connection used from the event loop's thread only; autocommit mode.
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Columns added since a state directory was made (SQLite adds them in place)."""
        for table, column, kind in (
            ("calls", "media_type", "TEXT"),  # of a result that is a file, not JSON
            ("calls", "filename", "TEXT"),
            ("calls", "webhook", "TEXT"),  # the URL told of a spawned call's end
            ("calls", "webhook_state", "TEXT"),
            ("tokens", "app", "TEXT"),  # of a token for one app
            ("tokens", "rate_limit", "TEXT"),  # calls per period it may make
            ("tokens", "expires_at", "REAL"),  # when it stops working
            ("deployments", "canary_percent", "INTEGER"),  # canaries
            ("deployments", "withdrawn", "INTEGER NOT NULL DEFAULT 0"),
            ("snapshots", "image_id", "TEXT NOT NULL DEFAULT ''"),  # which dump of the key
            ("snapshots", "restores", "INTEGER NOT NULL DEFAULT 0"),
            ("snapshots", "last_restored_at", "REAL"),
            ("snapshots", "last_restore_seconds", "REAL"),
        ):
            columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def put_deployment(self, deployment: Deployment) -> None:
        self._write(
            "INSERT OR REPLACE INTO deployments (app, version, bundle_digest, manifest, "
            "created_at, stopped, canary_percent, withdrawn) VALUES (?, ?, ?, ?, ?, 0, ?, ?)",
            (
                deployment.app,
                deployment.version,
                deployment.bundle_digest,
                json.dumps(deployment.manifest),
                deployment.created_at,
                deployment.canary_percent,
                int(deployment.withdrawn),
            ),
        )

    def latest_deployments(self) -> list[Deployment]:
        rows = self._db.execute(
            f"SELECT {DEPLOYMENT_COLUMNS} FROM deployments d WHERE {SERVES} AND version = "
            f"(SELECT MAX(version) FROM deployments WHERE app = d.app AND {SERVES}) ORDER BY app"
        ).fetchall()
        return [_deployment(row) for row in rows]

    def canary_deployments(self) -> list[Deployment]:
        rows = self._db.execute(
            f"SELECT {DEPLOYMENT_COLUMNS} FROM deployments WHERE stopped = 0 AND withdrawn = 0 "
            "AND canary_percent IS NOT NULL ORDER BY app, version"
        ).fetchall()
        return [_deployment(row) for row in rows]

    def list_deployments(self, app: str) -> list[Deployment]:
        rows = self._db.execute(
            f"SELECT {DEPLOYMENT_COLUMNS} FROM deployments WHERE app = ? ORDER BY version",
            (app,),
        ).fetchall()
        return [_deployment(row) for row in rows]

    def set_canary_percent(self, app: str, version: int, percent: int | None) -> None:
        self._write(
            "UPDATE deployments SET canary_percent = ? WHERE app = ? AND version = ?",
            (percent, app, version),
        )

    def withdraw_deployment(self, app: str, version: int) -> None:
        self._write(
            "UPDATE deployments SET withdrawn = 1 WHERE app = ? AND version = ?", (app, version)
        )

    def next_version(self, app: str) -> int:
        row = self._db.execute(
            "SELECT COALESCE(MAX(version), 0) FROM deployments WHERE app = ?", (app,)
        ).fetchone()
        return int(row[0]) + 1

    def delete_app(self, app: str) -> bool:
        cursor = self._write(
            "UPDATE deployments SET stopped = 1 WHERE app = ? AND stopped = 0", (app,)
        )
        self._write("DELETE FROM scaling_overrides WHERE app = ?", (app,))
        return cursor.rowcount > 0

    def put_scaling_override(self, override: ScalingOverride) -> None:
        self._write(
            "INSERT OR REPLACE INTO scaling_overrides VALUES (?, ?, ?, ?, ?)",
            (
                override.label,
                override.app,
                override.version,
                json.dumps(override.settings),
                override.updated_at,
            ),
        )

    def list_scaling_overrides(self) -> list[ScalingOverride]:
        rows = self._db.execute("SELECT * FROM scaling_overrides ORDER BY label")
        return [ScalingOverride(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]

    def delete_scaling_override(self, label: str) -> None:
        self._write("DELETE FROM scaling_overrides WHERE label = ?", (label,))

    def put_draining_node(self, name: str, since: float) -> None:
        self._write("INSERT OR IGNORE INTO draining_nodes VALUES (?, ?)", (name, since))

    def delete_draining_node(self, name: str) -> None:
        self._write("DELETE FROM draining_nodes WHERE name = ?", (name,))

    def list_draining_nodes(self) -> list[str]:
        rows = self._db.execute("SELECT name FROM draining_nodes ORDER BY name")
        return [row[0] for row in rows]

    def add_token(self, token: TokenRecord) -> None:
        self._write(
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
        self._write(
            "INSERT OR REPLACE INTO secrets VALUES (?, ?, ?)",
            (secret.name, json.dumps(secret.values), secret.updated_at),
        )

    def list_secrets(self) -> list[SecretRecord]:
        rows = self._db.execute("SELECT name, secret_values, updated_at FROM secrets")
        return [SecretRecord(name, json.loads(values), at) for name, values, at in rows]

    def delete_secret(self, name: str) -> bool:
        return self._write("DELETE FROM secrets WHERE name = ?", (name,)).rowcount > 0

    def delete_token(self, token_hash: str) -> bool:
        cursor = self._write("DELETE FROM tokens WHERE token_hash = ?", (token_hash,))
        return cursor.rowcount > 0

    def put_call(self, call: CallRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                call.id,
                call.label,
                call.method,
                call.body,
                call.status.value,
                call.attempts,
                call.created_at,
                call.finished_at,
                call.http_status,
                call.result,
                call.media_type,
                call.filename,
                call.webhook,
                call.webhook_state,
            ),
        )

    def get_call(self, call_id: str) -> CallRecord | None:
        row = self._db.execute("SELECT * FROM calls WHERE id = ?", (call_id,)).fetchone()
        return self._call(row) if row else None

    def unfinished_calls(self) -> list[CallRecord]:
        rows = self._db.execute(
            "SELECT * FROM calls WHERE status IN ('queued', 'running') ORDER BY created_at"
        ).fetchall()
        return [self._call(row) for row in rows]

    def pending_webhooks(self) -> list[CallRecord]:
        rows = self._db.execute(
            "SELECT * FROM calls WHERE webhook_state = ? ORDER BY finished_at", (WEBHOOK_PENDING,)
        ).fetchall()
        return [self._call(row) for row in rows]

    def recent_calls(self, app: str | None, label: str | None, limit: int) -> list[CallRecord]:
        params: tuple[str | int, ...]
        if label is not None:
            where, params = "label = ?", (label,)
        elif app is not None:
            prefix = make_label(app, "")  # "app--": no other app's labels start with it
            where, params = "substr(label, 1, ?) = ?", (len(prefix), prefix)
        else:
            where, params = "1", ()
        rows = self._db.execute(
            f"SELECT * FROM calls WHERE {where} ORDER BY created_at DESC LIMIT ?",
            (*params, limit),
        ).fetchall()
        return [self._call(row) for row in rows]

    def delete_calls_finished_before(self, timestamp: float) -> int:
        cursor = self._write(
            "DELETE FROM calls WHERE finished_at IS NOT NULL AND finished_at < ?", (timestamp,)
        )
        return cursor.rowcount

    def put_usage(self, usage: ReplicaUsage) -> None:
        self._write(
            "INSERT OR REPLACE INTO replica_usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                usage.replica_id,
                usage.app,
                usage.endpoint,
                usage.gpu_type,
                usage.gpu_count,
                usage.cpu,
                usage.memory_mib,
                usage.start_kind,
                usage.inputs,
                usage.started_at,
                usage.ended_at,
            ),
        )

    def usage_since(self, timestamp: float) -> list[ReplicaUsage]:
        rows = self._db.execute(
            "SELECT * FROM replica_usage WHERE ended_at >= ? ORDER BY started_at", (timestamp,)
        ).fetchall()
        return [ReplicaUsage(*row) for row in rows]

    def delete_usage_before(self, timestamp: float) -> int:
        return self._write("DELETE FROM replica_usage WHERE ended_at < ?", (timestamp,)).rowcount

    def put_snapshot(self, snapshot: SnapshotRecord) -> None:
        self._write(
            f"INSERT OR REPLACE INTO snapshots ({SNAPSHOT_COLUMNS}) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                snapshot.key,
                snapshot.label,
                snapshot.bundle_digest,
                snapshot.env_key,
                snapshot.size,
                snapshot.raw_size,
                snapshot.dump_seconds,
                snapshot.created_at,
                snapshot.image_id,
                snapshot.restores,
                snapshot.last_restored_at,
                snapshot.last_restore_seconds,
            ),
        )

    def list_snapshots(self) -> list[SnapshotRecord]:
        rows = self._db.execute(f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots ORDER BY created_at")
        return [SnapshotRecord(*row) for row in rows]

    def delete_snapshot(self, key: str) -> None:
        self._write("DELETE FROM snapshots WHERE key = ?", (key,))

    # ----- ember.Dict and ember.Queue: values are JSON text, kept as it came ---------
    def dict_get(self, app: str, name: str, key: str, now: float) -> bytes | None:
        row = self._db.execute(
            "SELECT value FROM dict_items WHERE app = ? AND name = ? AND key = ? "
            "AND (expires_at IS NULL OR expires_at > ?)",
            (app, name, key, now),
        ).fetchone()
        return None if row is None else bytes(row[0])

    def dict_put(
        self, app: str, name: str, key: str, value: bytes, expires_at: float | None
    ) -> None:
        self._write(
            "INSERT OR REPLACE INTO dict_items VALUES (?, ?, ?, ?, ?)",
            (app, name, key, value, expires_at),
        )

    def dict_delete(self, app: str, name: str, key: str, now: float) -> bytes | None:
        value = self.dict_get(app, name, key, now)
        self._write(
            "DELETE FROM dict_items WHERE app = ? AND name = ? AND key = ?", (app, name, key)
        )
        return value

    def dict_keys(
        self, app: str, name: str, now: float, limit: int, after: str | None = None
    ) -> list[str]:
        rows = self._db.execute(
            "SELECT key FROM dict_items WHERE app = ? AND name = ? "
            "AND (expires_at IS NULL OR expires_at > ?) AND key > ? ORDER BY key LIMIT ?",
            (app, name, now, after or "", limit),
        )
        return [row[0] for row in rows]

    def dict_count(self, app: str, name: str, now: float) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM dict_items WHERE app = ? AND name = ? "
            "AND (expires_at IS NULL OR expires_at > ?)",
            (app, name, now),
        ).fetchone()
        return int(row[0])

    def dict_clear(self, app: str, name: str) -> int:
        return self._write(
            "DELETE FROM dict_items WHERE app = ? AND name = ?", (app, name)
        ).rowcount

    def delete_expired_items(self, now: float) -> int:
        return self._write(
            "DELETE FROM dict_items WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
        ).rowcount

    def queue_put(self, app: str, name: str, values: list[bytes]) -> None:
        self._write_all(
            "INSERT INTO queue_items (app, name, value) VALUES (?, ?, ?)",
            [(app, name, value) for value in values],
        )

    def queue_take(self, app: str, name: str, most: int) -> list[bytes]:
        rows = self._db.execute(
            "SELECT seq, value FROM queue_items WHERE app = ? AND name = ? ORDER BY seq LIMIT ?",
            (app, name, most),
        ).fetchall()
        if rows:
            self._write(
                "DELETE FROM queue_items WHERE app = ? AND name = ? AND seq <= ?",
                (app, name, rows[-1][0]),
            )
        return [bytes(row[1]) for row in rows]

    def queue_length(self, app: str, name: str) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM queue_items WHERE app = ? AND name = ?", (app, name)
        ).fetchone()
        return int(row[0])

    def queue_clear(self, app: str, name: str) -> int:
        return self._write(
            "DELETE FROM queue_items WHERE app = ? AND name = ?", (app, name)
        ).rowcount

    # ----- ember.Volume: files by path, their contents in the blob store by digest -----
    def volume_files(
        self,
        app: str,
        volume: str,
        prefix: str = "",
        after: str | None = None,
        limit: int | None = None,
    ) -> list[VolumeFile]:
        sql = "SELECT path, digest, size, modified FROM volume_files WHERE app = ? AND volume = ?"
        parameters: tuple[Any, ...] = (app, volume)
        if prefix:  # the file itself, or what lies under it as a folder
            sql += " AND (path = ? OR substr(path, 1, ?) = ?)"
            parameters += (prefix, len(prefix) + 1, prefix + "/")
        if after is not None:  # a page: paths sort by code point, as Python's strings do
            sql += " AND path > ?"
            parameters += (after,)
        sql += " ORDER BY path"
        if limit is not None:
            sql += " LIMIT ?"
            parameters += (limit,)
        rows = self._db.execute(sql, parameters)
        return [VolumeFile(*row) for row in rows]

    def volume_file(self, app: str, volume: str, path: str) -> VolumeFile | None:
        row = self._db.execute(
            "SELECT path, digest, size, modified FROM volume_files "
            "WHERE app = ? AND volume = ? AND path = ?",
            (app, volume, path),
        ).fetchone()
        return None if row is None else VolumeFile(*row)

    def volume_put_file(self, app: str, volume: str, file: VolumeFile) -> None:
        self._write(
            "INSERT OR REPLACE INTO volume_files VALUES (?, ?, ?, ?, ?, ?)",
            (app, volume, file.path, file.digest, file.size, file.modified),
        )

    def volume_remove(self, app: str, volume: str, paths: list[str]) -> None:
        self._write_all(
            "DELETE FROM volume_files WHERE app = ? AND volume = ? AND path = ?",
            [(app, volume, path) for path in paths],
        )

    def volumes(self, app: str) -> list[tuple[str, int, int]]:
        rows = self._db.execute(
            "SELECT volume, COUNT(*), SUM(size) FROM volume_files WHERE app = ? "
            "GROUP BY volume ORDER BY volume",
            (app,),
        )
        return [(row[0], int(row[1]), int(row[2])) for row in rows]

    def volume_digest_used(self, digest: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM volume_files WHERE digest = ? LIMIT 1", (digest,)
        ).fetchone()
        return row is not None

    def blob_deletes(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT key FROM blob_deletes ORDER BY key")]

    def add_blob_delete(self, key: str, failed_at: float) -> None:
        self._write(
            "INSERT OR IGNORE INTO blob_deletes (key, failed_at) VALUES (?, ?)", (key, failed_at)
        )

    def remove_blob_delete(self, key: str) -> None:
        self._write("DELETE FROM blob_deletes WHERE key = ?", (key,))

    def close(self) -> None:
        self._db.close()

    def _write_all(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """One statement per row, in one transaction: all of them or none."""
        try:
            self._db.execute("BEGIN")
            self._db.executemany(sql, rows)
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as error:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise StoreWriteError(f"the state database could not be written: {error}") from None

    def _write(self, sql: str, parameters: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, parameters)
        except sqlite3.OperationalError as error:  # full disk, I/O error: nothing written
            raise StoreWriteError(f"the state database could not be written: {error}") from None

    @staticmethod
    def _call(row: tuple) -> CallRecord:
        return CallRecord(
            id=row[0],
            label=row[1],
            method=row[2],
            body=bytes(row[3]),
            status=CallStatus(row[4]),
            attempts=row[5],
            created_at=row[6],
            finished_at=row[7],
            http_status=row[8],
            result=bytes(row[9]) if row[9] is not None else None,
            media_type=row[10],
            filename=row[11],
            webhook=row[12],
            webhook_state=row[13],
        )
