"""The PostgreSQL state store's one connection, shared by its tables: opened with the
schema brought up to date (`storage/migrations.py`), opened again when it was lost, and
writes that fail as `StoreWriteError`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from ember.errors import ConfigError
from ember_platform.storage.migrations import MIGRATIONS_TABLE, Migration, pending
from ember_platform.storage.postgres.dialect import postgres_ddl, postgres_sql, shown
from ember_platform.storage.state_store import StoreWriteError

CONNECT_TIMEOUT_S = 10
# pg_advisory_xact_lock's key while migrating: processes opening one database together
# take the migrations one at a time ("ember" in ASCII).
MIGRATION_LOCK = 0x656D626572


class PostgresDatabase:
    def __init__(self, url: str) -> None:
        self.url = url
        # Used from the event loop's thread, and now and then from another: a transaction
        # must not take in another thread's statements.
        self._lock = threading.RLock()
        try:
            self._conn = self._connect()
        except psycopg.OperationalError as error:
            raise ConfigError(
                f"cannot reach the state database {shown(url)}: {_first_line(error)}; "
                "check --database (or $EMBER_DATABASE_URL) and that PostgreSQL is running"
            ) from None
        try:
            self._migrate()
        except BaseException:
            self._conn.close()
            raise

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name="ember-server",
        )

    def _connection(self) -> psycopg.Connection[Any]:
        """The connection, made again if it was lost (the database restarted, say):
        psycopg.OperationalError while the database cannot be reached."""
        if self._conn.closed or self._conn.broken:
            self._conn.close()
            self._conn = self._connect()
        return self._conn

    def _migrate(self) -> None:
        with self._lock, self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            self._conn.execute(postgres_ddl(MIGRATIONS_TABLE))
            row = self._conn.execute(
                "SELECT COALESCE(MAX(version), 0) FROM schema_migrations"
            ).fetchone()
            for migration in pending(int(row[0]) if row else 0):
                self._apply(migration)

    def _apply(self, migration: Migration) -> None:
        for statement in migration.statements:
            self._conn.execute(postgres_ddl(statement))
        for table, column, kind in migration.columns:
            self._conn.execute(
                f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {postgres_ddl(kind)}"
            )
        self._conn.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (%s, %s, %s)",
            (migration.version, migration.name, time.time()),
        )

    def execute(self, sql: str, parameters: tuple[Any, ...] = ()) -> psycopg.Cursor[Any]:
        """A read: its failures stay as psycopg raises them."""
        with self._lock:
            return self._connection().execute(postgres_sql(sql), parameters)

    def write(self, sql: str, parameters: tuple[Any, ...]) -> psycopg.Cursor[Any]:
        with self._writing():
            return self._connection().execute(postgres_sql(sql), parameters)

    def write_all(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """One statement per row, in one transaction: all of them or none."""
        with self._writing():
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cursor:
                cursor.executemany(postgres_sql(sql), rows)

    def write_each(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Several statements in one transaction: all of them or none."""
        with self._writing():
            conn = self._connection()
            with conn.transaction():
                for sql, parameters in statements:
                    conn.execute(postgres_sql(sql), parameters)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A write, as StoreWriteError when the database did not take it: it is out of
        reach, out of disk, read-only, or refused the value. A key taken already
        (IntegrityError) and a statement that is wrong (ProgrammingError) stay as they
        are, as with SQLite."""
        with self._lock:
            try:
                yield
            except (psycopg.IntegrityError, psycopg.ProgrammingError):
                raise
            except psycopg.Error as error:
                raise StoreWriteError(
                    f"the state database could not be written: {_first_line(error)}"
                ) from None

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
