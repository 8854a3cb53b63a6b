"""Spawned calls: their arguments, state and result, kept a day after they end."""

from __future__ import annotations

from ember.wire.labels import MAIN_WORKSPACE, make_label
from ember_platform.storage.records import WEBHOOK_PENDING, CallRecord, CallStatus
from ember_platform.storage.tables.database import Database, upsert

CALL_COLUMNS = (
    "id",
    "label",
    "method",
    "body",
    "status",
    "attempts",
    "created_at",
    "finished_at",
    "http_status",
    "result",
    "media_type",
    "filename",
    "webhook",
    "webhook_state",
)
PUT_CALL = upsert("calls", CALL_COLUMNS, ("id",))
SELECT_CALL = ", ".join(CALL_COLUMNS)


class CallTable:
    """The calls table."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def put_call(self, call: CallRecord) -> None:
        self._db.write(
            PUT_CALL,
            (
                call.id,
                call.label,
                call.method,
                call.body,
                call.status.value,
                call.attempts,
                call.created_at,
                call.finished_at,
                call.http_status,
                call.result,
                call.media_type,
                call.filename,
                call.webhook,
                call.webhook_state,
            ),
        )

    def get_call(self, call_id: str) -> CallRecord | None:
        row = self._db.execute(
            f"SELECT {SELECT_CALL} FROM calls WHERE id = ?", (call_id,)
        ).fetchone()
        return _call(row) if row else None

    def unfinished_calls(self) -> list[CallRecord]:
        rows = self._db.execute(
            f"SELECT {SELECT_CALL} FROM calls WHERE status IN ('queued', 'running') "
            "ORDER BY created_at"
        ).fetchall()
        return [_call(row) for row in rows]

    def pending_webhooks(self) -> list[CallRecord]:
        rows = self._db.execute(
            f"SELECT {SELECT_CALL} FROM calls WHERE webhook_state = ? ORDER BY finished_at",
            (WEBHOOK_PENDING,),
        ).fetchall()
        return [_call(row) for row in rows]

    def recent_calls(
        self,
        app: str | None,
        label: str | None,
        limit: int,
        workspace: str | None = MAIN_WORKSPACE,
    ) -> list[CallRecord]:
        params: tuple[str | int, ...]
        if label is not None:
            where, params = "label = ?", (label,)
        elif app is None and workspace is None:
            where, params = "1 = 1", ()  # every workspace's: the operator's listing
        else:
            # "key--" begins the labels of the app (or, with a workspace's name, of the
            # workspace); those of main's apps have no second "--".
            prefix = make_label(app if app is not None else str(workspace), "")
            # ("-" is no LIKE wildcard, and the patterns are in the SQL, not parameters.)
            rest = "substr(label, ?) LIKE '%--%'"
            if app is None and workspace == MAIN_WORKSPACE:
                where, params = "label NOT LIKE '%--%--%'", ()
            elif app is None:
                where = f"substr(label, 1, ?) = ? AND {rest}"
                params = (len(prefix), prefix, len(prefix) + 1)
            else:
                where = f"substr(label, 1, ?) = ? AND NOT {rest}"
                params = (len(prefix), prefix, len(prefix) + 1)
        rows = self._db.execute(
            f"SELECT {SELECT_CALL} FROM calls WHERE {where} ORDER BY created_at DESC LIMIT ?",
            (*params, limit),
        ).fetchall()
        return [_call(row) for row in rows]

    def delete_calls_finished_before(self, timestamp: float) -> int:
        cursor = self._db.write(
            "DELETE FROM calls WHERE finished_at IS NOT NULL AND finished_at < ?", (timestamp,)
        )
        return cursor.rowcount


def _call(row: tuple) -> CallRecord:
    return CallRecord(
        id=row[0],
        label=row[1],
        method=row[2],
        body=bytes(row[3]),
        status=CallStatus(row[4]),
        attempts=row[5],
        created_at=row[6],
        finished_at=row[7],
        http_status=row[8],
        result=bytes(row[9]) if row[9] is not None else None,
        media_type=row[10],
        filename=row[11],
        webhook=row[12],
        webhook_state=row[13],
    )
