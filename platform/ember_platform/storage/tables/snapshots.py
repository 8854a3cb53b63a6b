"""Snapshot images (what each key's replicas restore from), and the blob deletes the
blob store failed, to send again later."""

from __future__ import annotations

from ember_platform.storage.records import SnapshotRecord
from ember_platform.storage.tables.database import Database, insert_new, upsert

COLUMNS = (
    "key",
    "label",
    "bundle_digest",
    "env_key",
    "size",
    "raw_size",
    "dump_seconds",
    "created_at",
    "image_id",
    "restores",
    "last_restored_at",
    "last_restore_seconds",
)
SNAPSHOT_COLUMNS = ", ".join(COLUMNS)
PUT_SNAPSHOT = upsert("snapshots", COLUMNS, ("key",))
ADD_BLOB_DELETE = insert_new("blob_deletes", ("key", "failed_at"))


class SnapshotTables:
    """The snapshots and blob_deletes tables."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def put_snapshot(self, snapshot: SnapshotRecord) -> None:
        self._db.write(
            PUT_SNAPSHOT,
            (
                snapshot.key,
                snapshot.label,
                snapshot.bundle_digest,
                snapshot.env_key,
                snapshot.size,
                snapshot.raw_size,
                snapshot.dump_seconds,
                snapshot.created_at,
                snapshot.image_id,
                snapshot.restores,
                snapshot.last_restored_at,
                snapshot.last_restore_seconds,
            ),
        )

    def list_snapshots(self) -> list[SnapshotRecord]:
        rows = self._db.execute(f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots ORDER BY created_at")
        return [SnapshotRecord(*row) for row in rows]

    def delete_snapshot(self, key: str) -> None:
        self._db.write("DELETE FROM snapshots WHERE key = ?", (key,))

    def blob_deletes(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT key FROM blob_deletes ORDER BY key")]

    def add_blob_delete(self, key: str, failed_at: float) -> None:
        self._db.write(ADD_BLOB_DELETE, (key, failed_at))

    def remove_blob_delete(self, key: str) -> None:
        self._db.write("DELETE FROM blob_deletes WHERE key = ?", (key,))
