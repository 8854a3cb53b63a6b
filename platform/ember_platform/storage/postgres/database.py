"""The PostgreSQL state store's one connection, shared by its tables: opened with the
schema brought up to date (`storage/migrations.py`), made again when it was lost, and
failures as the store's errors: `StoreUnavailableError` while the database is out of
reach, `StoreWriteError` for a write it refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg

from ember.errors import ConfigError
from ember_platform.storage.migrations import MIGRATIONS_TABLE, Migration, pending
from ember_platform.storage.postgres.dialect import postgres_ddl, postgres_sql, shown
from ember_platform.storage.state_store import StoreUnavailableError, StoreWriteError

CONNECT_TIMEOUT_S = 10  # at start
# Later, while serving: the store is used from the event loop, so a database out of reach
# must cost a request little, and is tried again at most this often.
RECONNECT_TIMEOUT_S = 2
RECONNECT_INTERVAL_S = 1.0
# pg_advisory_xact_lock's key while migrating: processes opening one database together
# take the migrations one at a time ("ember" in ASCII).
MIGRATION_LOCK = 0x656D626572

T = TypeVar("T")


class PostgresDatabase:
    def __init__(self, url: str) -> None:
        self.url = url
        # Used from the event loop's thread, and now and then from another: a transaction
        # must not take in another thread's statements.
        self._lock = threading.RLock()
        self._failed_at = 0.0  # the last connection attempt that failed (monotonic)
        self._closed = False  # by close(): not to be opened again
        try:
            self._conn = self._connect(CONNECT_TIMEOUT_S)
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

    def _connect(self, timeout: float) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.url,
            autocommit=True,
            connect_timeout=max(1, round(timeout)),
            application_name="ember-server",
        )

    def _lost(self) -> bool:
        return self._conn.closed or self._conn.broken

    def _connection(self) -> psycopg.Connection[Any]:
        """The connection, made again if it was lost (the database restarted, say);
        StoreUnavailableError while the database cannot be reached."""
        if not self._lost():
            return self._conn
        if self._closed:
            raise StoreUnavailableError("the state store was closed")
        if time.monotonic() - self._failed_at < RECONNECT_INTERVAL_S:
            raise StoreUnavailableError(
                f"the state database {shown(self.url)} cannot be reached (tried again soon)"
            )
        self._conn.close()
        try:
            self._conn = self._connect(RECONNECT_TIMEOUT_S)
        except psycopg.OperationalError as error:
            self._failed_at = time.monotonic()
            raise StoreUnavailableError(
                f"the state database {shown(self.url)} cannot be reached: {_first_line(error)}"
            ) from None
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
        """A read: tried once more on a new connection if the old one turns out lost (a
        read changes nothing, so it may)."""
        query = postgres_sql(sql)
        with self._lock:
            try:
                return self._reaching(lambda: self._connection().execute(query, parameters))
            except StoreUnavailableError:
                if time.monotonic() - self._failed_at < RECONNECT_INTERVAL_S:
                    raise  # the database did not answer a new connection just now
                return self._reaching(lambda: self._connection().execute(query, parameters))

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

    def _reaching(self, read: Callable[[], T]) -> T:
        """A read, as StoreUnavailableError when the connection is lost under it."""
        try:
            return read()
        except psycopg.OperationalError as error:
            if not self._lost():
                raise
            raise StoreUnavailableError(
                f"the state database {shown(self.url)} was lost: {_first_line(error)}"
            ) from None

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A write: StoreUnavailableError when the database is out of reach (the write may
        not be tried again: it may have landed before the connection went),
        StoreWriteError when it refused the write (out of disk, read-only, a value it
        cannot hold). A key taken already (IntegrityError) and a wrong statement
        (ProgrammingError) stay as they are, as with SQLite."""
        with self._lock:
            try:
                yield
            except (psycopg.IntegrityError, psycopg.ProgrammingError):
                raise
            except psycopg.Error as error:
                if self._lost():
                    raise StoreUnavailableError(
                        f"the state database {shown(self.url)} was lost: {_first_line(error)}"
                    ) from None
                raise StoreWriteError(
                    f"the state database could not be written: {_first_line(error)}"
                ) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
