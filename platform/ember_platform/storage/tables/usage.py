"""The usage of replicas that ended: what each held, and for how long."""

from __future__ import annotations

import dataclasses

from ember_platform.storage.records import ReplicaUsage, TokenUsage
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
ADD_TOKENS = (
    "INSERT INTO token_usage (app, endpoint, traffic, minute, input_tokens, output_tokens, "
    "requests) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (app, endpoint, traffic, minute) "
    "DO UPDATE SET input_tokens = token_usage.input_tokens + excluded.input_tokens, "
    "output_tokens = token_usage.output_tokens + excluded.output_tokens, "
    "requests = token_usage.requests + excluded.requests"
)


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
        self._db.write("DELETE FROM token_usage WHERE minute < ?", (timestamp,))
        return self._db.write("DELETE FROM replica_usage WHERE ended_at < ?", (timestamp,)).rowcount

    def add_token_usage(self, usage: TokenUsage) -> None:
        self._db.write(ADD_TOKENS, dataclasses.astuple(usage))

    def token_usage_since(self, timestamp: float) -> list[TokenUsage]:
        """Each endpoint's and traffic's tokens since then, summed."""
        rows = self._db.execute(
            "SELECT app, endpoint, traffic, SUM(input_tokens), SUM(output_tokens), "
            "SUM(requests) FROM token_usage WHERE minute >= ? GROUP BY app, endpoint, traffic",
            (timestamp - 60,),  # the minute the period begins in
        ).fetchall()
        return [
            TokenUsage(r[0], r[1], r[2], timestamp, int(r[3]), int(r[4]), int(r[5])) for r in rows
        ]
