"""The usage of replicas that ended: what each held, and for how long."""

from __future__ import annotations

from ember_platform.storage.records import ReplicaUsage
from ember_platform.storage.tables.database import Database, upsert

COLUMNS = (
    "replica_id",
    "app",
    "endpoint",
    "gpu_type",
    "gpu_count",
    "cpu",
    "memory_mib",
    "start_kind",
    "inputs",
    "started_at",
    "ended_at",
)
PUT_USAGE = upsert("replica_usage", COLUMNS, ("replica_id",))


class UsageTable:
    """The replica_usage table."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def put_usage(self, usage: ReplicaUsage) -> None:
        self._db.write(
            PUT_USAGE,
            (
                usage.replica_id,
                usage.app,
                usage.endpoint,
                usage.gpu_type,
                usage.gpu_count,
                usage.cpu,
                usage.memory_mib,
                usage.start_kind,
                usage.inputs,
                usage.started_at,
                usage.ended_at,
            ),
        )

    def usage_since(self, timestamp: float) -> list[ReplicaUsage]:
        rows = self._db.execute(
            f"SELECT {', '.join(COLUMNS)} FROM replica_usage WHERE ended_at >= ? "
            "ORDER BY started_at",
            (timestamp,),
        ).fetchall()
        return [ReplicaUsage(*row) for row in rows]

    def delete_usage_before(self, timestamp: float) -> int:
        return self._db.write("DELETE FROM replica_usage WHERE ended_at < ?", (timestamp,)).rowcount
