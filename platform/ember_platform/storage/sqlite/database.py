"""The SQLite state store's one connection (WAL), shared by its tables: opened with the
schema brought up to date, and writes that fail as `StoreWriteError`."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ember_platform.storage.sqlite.schema import ADDED_COLUMNS, SCHEMA
from ember_platform.storage.state_store import StoreWriteError


class Database:
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
        for table, column, kind in ADDED_COLUMNS:
            columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

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
