"""The SQLite state store's one connection (WAL), shared by its tables: opened with the
schema brought up to date (`storage/migrations.py`), and writes that fail as
`StoreWriteError`."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from ember_platform.storage.migrations import MIGRATIONS_TABLE, Migration, pending
from ember_platform.storage.state_store import StoreWriteError


class SqliteDatabase:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)  # secrets' values and async calls' arguments are in it
        path.chmod(0o600)
        # One connection used from the event loop's thread only; autocommit mode.
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        self._db.execute(MIGRATIONS_TABLE)
        applied = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        for migration in pending(int(applied.fetchone()[0])):
            # SQLite's DDL is transactional: a migration is taken whole or not at all.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._apply(migration)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _apply(self, migration: Migration) -> None:
        for statement in migration.statements:
            self._db.execute(statement)
        for table, column, kind in migration.columns:
            columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._db.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
            (migration.version, migration.name, time.time()),
        )

    def execute(self, sql: str, parameters: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """A read (or a pragma): its failures are not a write's, and stay as they are."""
        return self._db.execute(sql, parameters)

    def write(self, sql: str, parameters: tuple[Any, ...]) -> sqlite3.Cursor:
        try:
            return self._db.execute(sql, parameters)
        except sqlite3.OperationalError as error:  # full disk, I/O error: nothing written
            raise StoreWriteError(f"the state database could not be written: {error}") from None

    def write_all(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """One statement per row, in one transaction: all of them or none."""
        try:
            self._db.execute("BEGIN")
            self._db.executemany(sql, rows)
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as error:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise StoreWriteError(f"the state database could not be written: {error}") from None

    def write_each(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Several statements in one transaction: all of them or none."""
        try:
            self._db.execute("BEGIN")
            for sql, parameters in statements:
                self._db.execute(sql, parameters)
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as error:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise StoreWriteError(f"the state database could not be written: {error}") from None

    def close(self) -> None:
        self._db.close()
