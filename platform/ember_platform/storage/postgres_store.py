"""PostgreSQL state store: `ember server --database postgresql://...`, for a database that
outlives the control plane's machine.

Its tables (`storage/tables/`) and migrations are SQLite's; this is the store on one
psycopg connection (`storage/postgres/database.py`)."""

from __future__ import annotations

from ember_platform.storage.postgres.database import PostgresDatabase
from ember_platform.storage.tables.store import TableStateStore


class PostgresStateStore(TableStateStore):
    def __init__(self, url: str) -> None:
        super().__init__(PostgresDatabase(url))
