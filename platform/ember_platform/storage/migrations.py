"""The state store's schema, as one list of versioned migrations both backends read.

Each database records the migrations it has taken in `schema_migrations`; opening a store
applies the ones it lacks, in order, each in one transaction. The SQL is written once, in
SQLite's column types (TEXT, INTEGER, REAL, BLOB); PostgreSQL reads it through
`postgres.database.postgres_ddl`, which maps those types to its own. A change to the schema
is a new migration appended here, never an edit of one already released.

Migration 1 is the schema as it stood when migrations began: it creates only what is
missing, and adds the columns that state directories made before some of them lack, so
a state database from before migrations is brought up to date in place."""

from __future__ import annotations

from dataclasses import dataclass

# The bookkeeping table itself, made before any migration runs.
MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at REAL NOT NULL
)"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]  # DDL in SQLite's types, run in order
    # (table, column, type) to add where missing: for databases made before migrations,
    # whose tables may lack columns added since (neither backend can say "if missing"
    # the same way, so each adds them its own way).
    columns: tuple[tuple[str, str, str], ...] = ()


BASELINE = (
    """CREATE TABLE IF NOT EXISTS deployments (
    app TEXT NOT NULL,
    version INTEGER NOT NULL,
    bundle_digest TEXT NOT NULL,
    manifest TEXT NOT NULL,
    created_at REAL NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0,
    canary_percent INTEGER,
    withdrawn INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (app, version)
)""",
    """CREATE TABLE IF NOT EXISTS tokens (
    token_hash TEXT PRIMARY KEY,
    scope TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    app TEXT,
    rate_limit TEXT,
    expires_at REAL,
    workspace TEXT
)""",
    """CREATE TABLE IF NOT EXISTS secrets (
    name TEXT PRIMARY KEY,
    secret_values TEXT NOT NULL,
    updated_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS calls (
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
)""",
    """CREATE TABLE IF NOT EXISTS replica_usage (
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
)""",
    "CREATE INDEX IF NOT EXISTS replica_usage_ended ON replica_usage (ended_at)",
    """CREATE TABLE IF NOT EXISTS snapshots (
    key TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    bundle_digest TEXT NOT NULL,
    env_key TEXT NOT NULL,
    size INTEGER NOT NULL,
    raw_size INTEGER NOT NULL,
    dump_seconds REAL NOT NULL,
    created_at REAL NOT NULL,
    image_id TEXT NOT NULL DEFAULT '',
    restores INTEGER NOT NULL DEFAULT 0,
    last_restored_at REAL,
    last_restore_seconds REAL
)""",
    """CREATE TABLE IF NOT EXISTS scaling_overrides (
    label TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    version INTEGER NOT NULL,
    settings TEXT NOT NULL,
    updated_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS draining_nodes (
    name TEXT PRIMARY KEY,
    since REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS dict_items (
    app TEXT NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    expires_at REAL,
    PRIMARY KEY (app, name, key)
)""",
    # seq orders a queue's values: first in, first out.
    """CREATE TABLE IF NOT EXISTS queue_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    app TEXT NOT NULL,
    name TEXT NOT NULL,
    value BLOB NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS queue_items_by_queue ON queue_items (app, name, seq)",
    """CREATE TABLE IF NOT EXISTS volume_files (
    app TEXT NOT NULL,
    volume TEXT NOT NULL,
    path TEXT NOT NULL,
    digest TEXT NOT NULL,
    size INTEGER NOT NULL,
    modified REAL NOT NULL,
    PRIMARY KEY (app, volume, path)
)""",
    "CREATE INDEX IF NOT EXISTS volume_files_by_digest ON volume_files (digest)",
    """CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    created_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS blob_deletes (
    key TEXT PRIMARY KEY,
    failed_at REAL NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS calls_unfinished ON calls (status) "
    "WHERE status IN ('queued', 'running')",
    "CREATE INDEX IF NOT EXISTS calls_created ON calls (created_at)",
)

# Columns added to the tables above before migrations began (a state directory made
# earlier has the table without them).
BASELINE_COLUMNS = (
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

# Settings the platform records once and every later start must agree with (the blob
# store the state's bundles and images are in: `blob_store`).
PLATFORM_SETTINGS = (
    """CREATE TABLE IF NOT EXISTS platform_settings (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    set_at REAL NOT NULL
)""",
)

# Each endpoint's last replica start (its kind and phases, as `ember ls` shows them), so a
# restart of the control plane does not forget it.
ENDPOINT_STARTS = (
    """CREATE TABLE IF NOT EXISTS endpoint_starts (
    label TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    start TEXT NOT NULL,
    started_at REAL NOT NULL
)""",
)

# Leases of the work only one control-plane process may do at a time, by name: "platform"
# (every endpoint's queue and dispatch, scheduling, schedules, webhooks, garbage:
# `peers/platform_lease.py`), and the apps' ("app:..."), with a "member:..." row per live
# process (`peers/app_leases.py`). `expires_at` is on the database's clock.
LEASES = (
    """CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    holder_url TEXT NOT NULL,
    expires_at REAL NOT NULL,
    term INTEGER NOT NULL DEFAULT 1
)""",
)

# The dashboard's sessions (`security/dashboard_sessions.py`), by the hash of the cookie's
# id, so that they outlive the process that opened them (a new owner of the platform, a
# restart). Each is of a token: it ends with it.
DASHBOARD_SESSIONS = (
    """CREATE TABLE IF NOT EXISTS dashboard_sessions (
    session_hash TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL
)""",
)

# Each workspace's admission limits an admin set (`ember workspace set`), by name (main's
# too, which has no row in `workspaces`); a NULL is the server's default.
WORKSPACE_LIMITS = (
    """CREATE TABLE IF NOT EXISTS workspace_limits (
    workspace TEXT PRIMARY KEY,
    max_queued INTEGER,
    max_running INTEGER,
    rate TEXT,
    updated_at REAL NOT NULL
)""",
)

# The OpenAI Batch API's files and batches (`storage/tables/batches.py`), by endpoint label.
OPENAI_BATCHES = (
    """CREATE TABLE IF NOT EXISTS openai_files (
    id TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS openai_batches (
    id TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    status TEXT NOT NULL,
    document TEXT NOT NULL,
    next_line INTEGER NOT NULL,
    created_at REAL NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS openai_files_label ON openai_files (label, created_at)",
    "CREATE INDEX IF NOT EXISTS openai_batches_label ON openai_batches (label, created_at)",
    "CREATE INDEX IF NOT EXISTS openai_batches_status ON openai_batches (status)",
)

# Tokens LLM endpoints read and wrote, per endpoint, traffic (online, batch) and minute
# (`observability/token_usage.py`), kept as long as replicas' usage.
TOKEN_USAGE = (
    """CREATE TABLE IF NOT EXISTS token_usage (
    app TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    traffic TEXT NOT NULL,
    minute REAL NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    PRIMARY KEY (app, endpoint, traffic, minute)
)""",
    "CREATE INDEX IF NOT EXISTS token_usage_minute ON token_usage (minute)",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "baseline", BASELINE, BASELINE_COLUMNS),
    Migration(2, "platform_settings", PLATFORM_SETTINGS),
    Migration(3, "endpoint_starts", ENDPOINT_STARTS),
    Migration(4, "leases", LEASES),
    Migration(5, "dashboard_sessions", DASHBOARD_SESSIONS),
    Migration(6, "workspace_limits", WORKSPACE_LIMITS),
    Migration(7, "openai_batches", OPENAI_BATCHES),
    Migration(8, "token_usage", TOKEN_USAGE),
)


def pending(applied: int) -> list[Migration]:
    """The migrations past version `applied`, in order."""
    return [m for m in MIGRATIONS if m.version > applied]
