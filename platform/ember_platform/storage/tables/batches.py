"""The OpenAI Batch API's files and batches, each of the endpoint (label) it was made at.

A file's bytes are a blob (`openai-files/{id}`); its row says what OpenAI's file object
says. A batch's row holds its OpenAI object as JSON, its status apart (the runner looks
for the unfinished ones) and the next line of its input file to submit."""

from __future__ import annotations

from ember_platform.storage.records import BatchRecord, OpenAIFileRecord
from ember_platform.storage.tables.database import Database, upsert

FILE_COLUMNS = ("id", "label", "purpose", "filename", "bytes", "created_at")
BATCH_COLUMNS = ("id", "label", "status", "document", "next_line", "created_at")
PUT_FILE = upsert("openai_files", FILE_COLUMNS, ("id",))
PUT_BATCH = upsert("openai_batches", BATCH_COLUMNS, ("id",))
# Statuses a batch leaves only by the runner's work (OpenAI's names).
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


class BatchTables:
    """The openai_files and openai_batches tables."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def put_openai_file(self, file: OpenAIFileRecord) -> None:
        self._db.write(
            PUT_FILE,
            (file.id, file.label, file.purpose, file.filename, file.bytes, file.created_at),
        )

    def get_openai_file(self, file_id: str) -> OpenAIFileRecord | None:
        row = self._db.execute(
            f"SELECT {', '.join(FILE_COLUMNS)} FROM openai_files WHERE id = ?", (file_id,)
        ).fetchone()
        return OpenAIFileRecord(*row) if row else None

    def list_openai_files(self, label: str, limit: int) -> list[OpenAIFileRecord]:
        rows = self._db.execute(
            f"SELECT {', '.join(FILE_COLUMNS)} FROM openai_files WHERE label = ? "
            "ORDER BY created_at DESC, id LIMIT ?",
            (label, limit),
        ).fetchall()
        return [OpenAIFileRecord(*row) for row in rows]

    def openai_files_of_workspace(self, workspace: str) -> list[str]:
        """The ids of the files of every endpoint of a workspace other than main."""
        rows = self._db.execute(
            "SELECT id FROM openai_files WHERE label LIKE ?", (f"{workspace}--%--%",)
        ).fetchall()
        return [row[0] for row in rows]

    def delete_openai_file(self, file_id: str) -> bool:
        return self._db.write("DELETE FROM openai_files WHERE id = ?", (file_id,)).rowcount > 0

    def put_batch(self, batch: BatchRecord) -> None:
        self._db.write(
            PUT_BATCH,
            (
                batch.id,
                batch.label,
                batch.status,
                batch.document,
                batch.next_line,
                batch.created_at,
            ),
        )

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        row = self._db.execute(
            f"SELECT {', '.join(BATCH_COLUMNS)} FROM openai_batches WHERE id = ?", (batch_id,)
        ).fetchone()
        return BatchRecord(*row) if row else None

    def list_batches(self, label: str, limit: int) -> list[BatchRecord]:
        rows = self._db.execute(
            f"SELECT {', '.join(BATCH_COLUMNS)} FROM openai_batches WHERE label = ? "
            "ORDER BY created_at DESC, id LIMIT ?",
            (label, limit),
        ).fetchall()
        return [BatchRecord(*row) for row in rows]

    def unfinished_batches(self) -> list[BatchRecord]:
        marks = ", ".join("?" * len(UNFINISHED))
        rows = self._db.execute(
            f"SELECT {', '.join(BATCH_COLUMNS)} FROM openai_batches WHERE status IN ({marks}) "
            "ORDER BY created_at",
            UNFINISHED,
        ).fetchall()
        return [BatchRecord(*row) for row in rows]
