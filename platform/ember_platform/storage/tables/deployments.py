"""The apps' deployments (every version, canaries among them), the scaling overrides and
last replica starts of their endpoints, and the nodes being drained."""

from __future__ import annotations

import json
from typing import Any

from ember_platform.storage.records import Deployment, ScalingOverride
from ember_platform.storage.tables.database import Database, insert_new, upsert

DEPLOYMENT_COLUMNS = "app, version, bundle_digest, manifest, created_at, canary_percent, withdrawn"
# A version that serves its endpoints' calls (not a canary, not withdrawn or stopped).
SERVES = "stopped = 0 AND withdrawn = 0 AND canary_percent IS NULL"
PUT_DEPLOYMENT = upsert(
    "deployments",
    (
        "app",
        "version",
        "bundle_digest",
        "manifest",
        "created_at",
        "stopped",
        "canary_percent",
        "withdrawn",
    ),
    ("app", "version"),
)
PUT_START = upsert("endpoint_starts", ("label", "app", "start", "started_at"), ("label",))
PUT_OVERRIDE = upsert(
    "scaling_overrides", ("label", "app", "version", "settings", "updated_at"), ("label",)
)


def _deployment(row: tuple) -> Deployment:
    return Deployment(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5], bool(row[6]))


class DeploymentTables:
    """What runs: the deployments, scaling_overrides, endpoint_starts and draining_nodes
    tables."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def put_deployment(self, deployment: Deployment) -> None:
        self._db.write(
            PUT_DEPLOYMENT,
            (
                deployment.app,
                deployment.version,
                deployment.bundle_digest,
                json.dumps(deployment.manifest),
                deployment.created_at,
                0,  # a version put again is no longer stopped
                deployment.canary_percent,
                int(deployment.withdrawn),
            ),
        )

    def latest_deployments(self) -> list[Deployment]:
        rows = self._db.execute(
            f"SELECT {DEPLOYMENT_COLUMNS} FROM deployments d WHERE {SERVES} AND version = "
            f"(SELECT MAX(version) FROM deployments WHERE app = d.app AND {SERVES}) ORDER BY app"
        ).fetchall()
        return [_deployment(row) for row in rows]

    def canary_deployments(self) -> list[Deployment]:
        rows = self._db.execute(
            f"SELECT {DEPLOYMENT_COLUMNS} FROM deployments WHERE stopped = 0 AND withdrawn = 0 "
            "AND canary_percent IS NOT NULL ORDER BY app, version"
        ).fetchall()
        return [_deployment(row) for row in rows]

    def list_deployments(self, app: str) -> list[Deployment]:
        rows = self._db.execute(
            f"SELECT {DEPLOYMENT_COLUMNS} FROM deployments WHERE app = ? ORDER BY version",
            (app,),
        ).fetchall()
        return [_deployment(row) for row in rows]

    def set_canary_percent(self, app: str, version: int, percent: int | None) -> None:
        self._db.write(
            "UPDATE deployments SET canary_percent = ? WHERE app = ? AND version = ?",
            (percent, app, version),
        )

    def withdraw_deployment(self, app: str, version: int) -> None:
        self._db.write(
            "UPDATE deployments SET withdrawn = 1 WHERE app = ? AND version = ?", (app, version)
        )

    def next_version(self, app: str) -> int:
        row = self._db.execute(
            "SELECT COALESCE(MAX(version), 0) FROM deployments WHERE app = ?", (app,)
        ).fetchone()
        return int(row[0]) + 1

    def delete_app(self, app: str) -> bool:
        cursor = self._db.write(
            "UPDATE deployments SET stopped = 1 WHERE app = ? AND stopped = 0", (app,)
        )
        self._db.write("DELETE FROM scaling_overrides WHERE app = ?", (app,))
        self._db.write("DELETE FROM endpoint_starts WHERE app = ?", (app,))
        return cursor.rowcount > 0

    def put_endpoint_start(self, label: str, app: str, start: dict[str, Any], at: float) -> None:
        self._db.write(PUT_START, (label, app, json.dumps(start), at))

    def endpoint_starts(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT label, start FROM endpoint_starts ORDER BY label")
        return {label: json.loads(start) for label, start in rows}

    def put_scaling_override(self, override: ScalingOverride) -> None:
        self._db.write(
            PUT_OVERRIDE,
            (
                override.label,
                override.app,
                override.version,
                json.dumps(override.settings),
                override.updated_at,
            ),
        )

    def list_scaling_overrides(self) -> list[ScalingOverride]:
        rows = self._db.execute(
            "SELECT label, app, version, settings, updated_at FROM scaling_overrides ORDER BY label"
        )
        return [ScalingOverride(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]

    def delete_scaling_override(self, label: str) -> None:
        self._db.write("DELETE FROM scaling_overrides WHERE label = ?", (label,))

    def put_draining_node(self, name: str, since: float) -> None:
        self._db.write(insert_new("draining_nodes", ("name", "since")), (name, since))

    def delete_draining_node(self, name: str) -> None:
        self._db.write("DELETE FROM draining_nodes WHERE name = ?", (name,))

    def list_draining_nodes(self) -> list[str]:
        rows = self._db.execute("SELECT name FROM draining_nodes ORDER BY name")
        return [row[0] for row in rows]
