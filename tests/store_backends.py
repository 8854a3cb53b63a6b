"""The state store's two backends, for the tests that run on both: `open_store` (the
fixture in tests/conftest.py) gives each such test a `StoreOpener`."""

from __future__ import annotations

from pathlib import Path

from ember_platform.storage.postgres_store import PostgresStateStore
from ember_platform.storage.sqlite_store import SqliteStateStore
from ember_platform.storage.tables.store import TableStateStore


class StoreOpener:
    """Opens the state store of one test's database, on one backend, as often as the test
    asks (each time on the same data: a restart)."""

    def __init__(self, backend: str, where: str) -> None:
        self.backend = backend
        self.where = where  # the SQLite file, or the PostgreSQL URL
        self.opened: list[TableStateStore] = []

    def __call__(self) -> TableStateStore:
        store: TableStateStore
        if self.backend == "sqlite":
            store = SqliteStateStore(Path(self.where))
        else:
            store = PostgresStateStore(self.where)
        self.opened.append(store)
        return store
