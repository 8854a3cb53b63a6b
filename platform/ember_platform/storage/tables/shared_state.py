"""ember.Dict and ember.Queue: values are JSON text, kept as it came."""

from __future__ import annotations

from ember_platform.storage.tables.database import Database, upsert

PUT_ITEM = upsert(
    "dict_items", ("app", "name", "key", "value", "expires_at"), ("app", "name", "key")
)


class SharedStateTables:
    """The dict_items and queue_items tables."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def dict_get(self, app: str, name: str, key: str, now: float) -> bytes | None:
        row = self._db.execute(
            "SELECT value FROM dict_items WHERE app = ? AND name = ? AND key = ? "
            "AND (expires_at IS NULL OR expires_at > ?)",
            (app, name, key, now),
        ).fetchone()
        return None if row is None else bytes(row[0])

    def dict_put(
        self, app: str, name: str, key: str, value: bytes, expires_at: float | None
    ) -> None:
        self._db.write(
            PUT_ITEM,
            (app, name, key, value, expires_at),
        )

    def dict_delete(self, app: str, name: str, key: str, now: float) -> bytes | None:
        # One statement: two processes deleting the key cannot both have its value. (All
        # rows fetched: SQLite ends the statement, and its transaction, only then.)
        rows = self._db.write(
            "DELETE FROM dict_items WHERE app = ? AND name = ? AND key = ? "
            "RETURNING value, expires_at",
            (app, name, key),
        ).fetchall()
        if not rows or (rows[0][1] is not None and rows[0][1] <= now):
            return None
        return bytes(rows[0][0])

    def dict_keys(
        self, app: str, name: str, now: float, limit: int, after: str | None = None
    ) -> list[str]:
        rows = self._db.execute(
            "SELECT key FROM dict_items WHERE app = ? AND name = ? "
            "AND (expires_at IS NULL OR expires_at > ?) AND key > ? ORDER BY key LIMIT ?",
            (app, name, now, after or "", limit),
        )
        return [row[0] for row in rows]

    def dict_count(self, app: str, name: str, now: float) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM dict_items WHERE app = ? AND name = ? "
            "AND (expires_at IS NULL OR expires_at > ?)",
            (app, name, now),
        ).fetchone()
        return int(row[0])

    def dict_clear(self, app: str, name: str) -> int:
        return self._db.write(
            "DELETE FROM dict_items WHERE app = ? AND name = ?", (app, name)
        ).rowcount

    def delete_expired_items(self, now: float) -> int:
        return self._db.write(
            "DELETE FROM dict_items WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
        ).rowcount

    def queue_put(self, app: str, name: str, values: list[bytes]) -> None:
        self._db.write_all(
            "INSERT INTO queue_items (app, name, value) VALUES (?, ?, ?)",
            [(app, name, value) for value in values],
        )

    def queue_take(self, app: str, name: str, most: int) -> list[bytes]:
        # One statement, so that no value is taken twice (RETURNING's rows come in no
        # promised order: seq puts them back in it).
        rows = self._db.write(
            "DELETE FROM queue_items WHERE seq IN (SELECT seq FROM queue_items "
            "WHERE app = ? AND name = ? ORDER BY seq LIMIT ?) RETURNING seq, value",
            (app, name, most),
        ).fetchall()
        return [bytes(value) for _, value in sorted(rows)]

    def queue_length(self, app: str, name: str) -> int:
        row = self._db.execute(
            "SELECT COUNT(*) FROM queue_items WHERE app = ? AND name = ?", (app, name)
        ).fetchone()
        return int(row[0])

    def queue_clear(self, app: str, name: str) -> int:
        return self._db.write(
            "DELETE FROM queue_items WHERE app = ? AND name = ?", (app, name)
        ).rowcount
