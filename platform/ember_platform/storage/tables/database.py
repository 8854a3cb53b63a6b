"""What the tables need of a backend's connection, and the SQL both backends share.

The tables write their SQL once, with `?` for parameters and in the dialect SQLite and
PostgreSQL have in common (upserts as `ON CONFLICT`, no `INSERT OR REPLACE`); each
backend's `Database` runs it, and turns a failed write into `StoreWriteError`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol


class Rows(Protocol):
    """A statement's result: its rows, and how many it changed."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Database(Protocol):
    def execute(self, sql: str, parameters: tuple[Any, ...] = ()) -> Rows:
        """A read: its failures stay as the driver raises them."""
        ...

    def write(self, sql: str, parameters: tuple[Any, ...]) -> Rows: ...

    def write_all(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """One statement per row, in one transaction: all of them or none."""
        ...

    def write_each(self, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Several statements in one transaction: all of them or none."""
        ...

    def close(self) -> None: ...


def upsert(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """Insert a row, or replace every given column of the one with its key."""
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}"
    )


def insert_new(table: str, columns: Sequence[str]) -> str:
    """Insert a row unless one with its key is there already."""
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        "ON CONFLICT DO NOTHING"
    )
