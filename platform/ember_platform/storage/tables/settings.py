"""Platform settings the state records once: the first start's value stands, and every
later start (or another process on the same database) is compared with it."""

from __future__ import annotations

import time

from ember_platform.storage.tables.database import Database, insert_new, upsert

COLUMNS = ("name", "value", "set_at")
CLAIM = insert_new("platform_settings", COLUMNS)
PUT = upsert("platform_settings", COLUMNS, ("name",))


class SettingsTable:
    def __init__(self, db: Database) -> None:
        self._db = db

    def claim_setting(self, name: str, value: str) -> str:
        """Record `value` unless the setting has one already; the value that stands.
        Two processes claiming at once: one insert wins, both read the winner's."""
        self._db.write(CLAIM, (name, value, time.time()))
        row = self._db.execute(
            "SELECT value FROM platform_settings WHERE name = ?", (name,)
        ).fetchone()
        return str(row[0])

    def put_setting(self, name: str, value: str) -> None:
        self._db.write(PUT, (name, value, time.time()))
