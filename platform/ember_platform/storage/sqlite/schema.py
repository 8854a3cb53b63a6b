"""The SQLite state store's tables, and the columns added to them since a state
directory could have been made (SQLite adds those in place)."""

from __future__ import annotations

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
CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blob_deletes (
    key TEXT PRIMARY KEY,
    failed_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_unfinished ON calls (status) WHERE status IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS calls_created ON calls (created_at);
"""

# (table, column, type) of columns added since a state directory was made.
ADDED_COLUMNS = (
    ("calls", "media_type", "TEXT"),  # of a result that is a file, not JSON
    ("calls", "filename", "TEXT"),
    ("calls", "webhook", "TEXT"),  # the URL told of a spawned call's end
    ("calls", "webhook_state", "TEXT"),
    ("tokens", "app", "TEXT"),  # of a token for one app
    ("tokens", "rate_limit", "TEXT"),  # calls per period it may make
    ("tokens", "expires_at", "REAL"),  # when it stops working
    ("tokens", "workspace", "TEXT"),  # of a deploy or invoke token
    ("deployments", "canary_percent", "INTEGER"),  # canaries
    ("deployments", "withdrawn", "INTEGER NOT NULL DEFAULT 0"),
    ("snapshots", "image_id", "TEXT NOT NULL DEFAULT ''"),  # which dump of the key
    ("snapshots", "restores", "INTEGER NOT NULL DEFAULT 0"),
    ("snapshots", "last_restored_at", "REAL"),
    ("snapshots", "last_restore_seconds", "REAL"),
)
