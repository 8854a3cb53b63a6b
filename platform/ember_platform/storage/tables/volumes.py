"""ember.Volume: files by path, their contents in the blob store by digest."""

from __future__ import annotations

from typing import Any

from ember_platform.storage.records import VolumeFile
from ember_platform.storage.tables.database import Database, upsert

PUT_FILE = upsert(
    "volume_files",
    ("app", "volume", "path", "digest", "size", "modified"),
    ("app", "volume", "path"),
)


class VolumeTable:
    """The volume_files table."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def volume_files(
        self,
        app: str,
        volume: str,
        prefix: str = "",
        after: str | None = None,
        limit: int | None = None,
    ) -> list[VolumeFile]:
        sql = "SELECT path, digest, size, modified FROM volume_files WHERE app = ? AND volume = ?"
        parameters: tuple[Any, ...] = (app, volume)
        if prefix:  # the file itself, or what lies under it as a folder
            sql += " AND (path = ? OR substr(path, 1, ?) = ?)"
            parameters += (prefix, len(prefix) + 1, prefix + "/")
        if after is not None:  # a page: paths sort by code point, as Python's strings do
            sql += " AND path > ?"
            parameters += (after,)
        sql += " ORDER BY path"
        if limit is not None:
            sql += " LIMIT ?"
            parameters += (limit,)
        rows = self._db.execute(sql, parameters)
        return [VolumeFile(*row) for row in rows]

    def volume_file(self, app: str, volume: str, path: str) -> VolumeFile | None:
        row = self._db.execute(
            "SELECT path, digest, size, modified FROM volume_files "
            "WHERE app = ? AND volume = ? AND path = ?",
            (app, volume, path),
        ).fetchone()
        return None if row is None else VolumeFile(*row)

    def volume_put_file(self, app: str, volume: str, file: VolumeFile) -> None:
        self._db.write(
            PUT_FILE,
            (app, volume, file.path, file.digest, file.size, file.modified),
        )

    def volume_remove(self, app: str, volume: str, paths: list[str]) -> None:
        self._db.write_all(
            "DELETE FROM volume_files WHERE app = ? AND volume = ? AND path = ?",
            [(app, volume, path) for path in paths],
        )

    def volumes(self, app: str) -> list[tuple[str, int, int]]:
        rows = self._db.execute(
            "SELECT volume, COUNT(*), SUM(size) FROM volume_files WHERE app = ? "
            "GROUP BY volume ORDER BY volume",
            (app,),
        )
        return [(row[0], int(row[1]), int(row[2])) for row in rows]

    def volume_digest_used(self, digest: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM volume_files WHERE digest = ? LIMIT 1", (digest,)
        ).fetchone()
        return row is not None
