"""SQLite state store (WAL): the embedded default, one file in the state dir.

Its tables (`storage/tables/`) are the same as PostgreSQL's; this is the store on one
SQLite connection (`storage/sqlite/database.py`)."""

from __future__ import annotations

from pathlib import Path

from ember_platform.storage.sqlite.database import SqliteDatabase
from ember_platform.storage.tables.store import TableStateStore


class SqliteStateStore(TableStateStore):
    def __init__(self, path: Path) -> None:
        super().__init__(SqliteDatabase(path))
