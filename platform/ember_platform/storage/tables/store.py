"""The `StateStore` both backends are: it hands each method to the table that keeps it,
on the backend's `Database`."""

from __future__ import annotations

from typing import Any

from ember.wire.labels import MAIN_WORKSPACE
from ember_platform.storage.records import (
    BatchRecord,
    CallRecord,
    Deployment,
    OpenAIFileRecord,
    ReplicaUsage,
    ScalingOverride,
    SecretRecord,
    SnapshotRecord,
    TokenRecord,
    TokenUsage,
    VolumeFile,
    WorkspaceLimitsRecord,
    WorkspaceRecord,
)
from ember_platform.storage.tables.batches import BatchTables
from ember_platform.storage.tables.calls import CallTable
from ember_platform.storage.tables.credentials import CredentialTables
from ember_platform.storage.tables.database import Database
from ember_platform.storage.tables.deployments import DeploymentTables
from ember_platform.storage.tables.settings import SettingsTable
from ember_platform.storage.tables.shared_state import SharedStateTables
from ember_platform.storage.tables.snapshots import SnapshotTables
from ember_platform.storage.tables.usage import UsageTable
from ember_platform.storage.tables.volumes import VolumeTable


class TableStateStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._deployments = DeploymentTables(self._db)
        self._calls = CallTable(self._db)
        self._usage = UsageTable(self._db)
        self._credentials = CredentialTables(self._db)
        self._shared_state = SharedStateTables(self._db)
        self._volumes = VolumeTable(self._db)
        self._snapshots = SnapshotTables(self._db)
        self._settings = SettingsTable(self._db)
        self._batches = BatchTables(self._db)

    def claim_setting(self, name: str, value: str) -> str:
        return self._settings.claim_setting(name, value)

    def put_setting(self, name: str, value: str) -> None:
        self._settings.put_setting(name, value)

    def put_deployment(self, deployment: Deployment) -> None:
        self._deployments.put_deployment(deployment)

    def latest_deployments(self) -> list[Deployment]:
        return self._deployments.latest_deployments()

    def canary_deployments(self) -> list[Deployment]:
        return self._deployments.canary_deployments()

    def list_deployments(self, app: str) -> list[Deployment]:
        return self._deployments.list_deployments(app)

    def set_canary_percent(self, app: str, version: int, percent: int | None) -> None:
        self._deployments.set_canary_percent(app, version, percent)

    def withdraw_deployment(self, app: str, version: int) -> None:
        self._deployments.withdraw_deployment(app, version)

    def next_version(self, app: str) -> int:
        return self._deployments.next_version(app)

    def delete_app(self, app: str) -> bool:
        return self._deployments.delete_app(app)

    def put_scaling_override(self, override: ScalingOverride) -> None:
        self._deployments.put_scaling_override(override)

    def list_scaling_overrides(self) -> list[ScalingOverride]:
        return self._deployments.list_scaling_overrides()

    def delete_scaling_override(self, label: str) -> None:
        self._deployments.delete_scaling_override(label)

    def put_endpoint_start(self, label: str, app: str, start: dict[str, Any], at: float) -> None:
        self._deployments.put_endpoint_start(label, app, start, at)

    def endpoint_starts(self) -> dict[str, dict[str, Any]]:
        return self._deployments.endpoint_starts()

    def put_draining_node(self, name: str, since: float) -> None:
        self._deployments.put_draining_node(name, since)

    def delete_draining_node(self, name: str) -> None:
        self._deployments.delete_draining_node(name)

    def list_draining_nodes(self) -> list[str]:
        return self._deployments.list_draining_nodes()

    def add_token(self, token: TokenRecord) -> None:
        self._credentials.add_token(token)

    def list_tokens(self) -> list[TokenRecord]:
        return self._credentials.list_tokens()

    def put_secret(self, secret: SecretRecord) -> None:
        self._credentials.put_secret(secret)

    def list_secrets(self) -> list[SecretRecord]:
        return self._credentials.list_secrets()

    def delete_secret(self, name: str) -> bool:
        return self._credentials.delete_secret(name)

    def delete_token(self, token_hash: str) -> bool:
        return self._credentials.delete_token(token_hash)

    def put_dashboard_session(
        self, session_hash: str, token_hash: str, expires_at: float, created_at: float
    ) -> None:
        self._credentials.put_dashboard_session(session_hash, token_hash, expires_at, created_at)

    def dashboard_session(self, session_hash: str) -> tuple[str, float] | None:
        return self._credentials.dashboard_session(session_hash)

    def delete_dashboard_sessions(self, session_hashes: list[str], ended_by: float) -> None:
        self._credentials.delete_dashboard_sessions(session_hashes, ended_by)

    def put_workspace(self, workspace: WorkspaceRecord) -> None:
        self._credentials.put_workspace(workspace)

    def list_workspaces(self) -> list[WorkspaceRecord]:
        return self._credentials.list_workspaces()

    def delete_workspace(self, name: str) -> bool:
        return self._credentials.delete_workspace(name)

    def put_workspace_limits(self, limits: WorkspaceLimitsRecord) -> None:
        self._credentials.put_workspace_limits(limits)

    def list_workspace_limits(self) -> list[WorkspaceLimitsRecord]:
        return self._credentials.list_workspace_limits()

    def put_call(self, call: CallRecord) -> None:
        self._calls.put_call(call)

    def get_call(self, call_id: str) -> CallRecord | None:
        return self._calls.get_call(call_id)

    def unfinished_calls(self) -> list[CallRecord]:
        return self._calls.unfinished_calls()

    def pending_webhooks(self) -> list[CallRecord]:
        return self._calls.pending_webhooks()

    def recent_calls(
        self,
        app: str | None,
        label: str | None,
        limit: int,
        workspace: str | None = MAIN_WORKSPACE,
    ) -> list[CallRecord]:
        return self._calls.recent_calls(app, label, limit, workspace)

    def delete_calls_finished_before(self, timestamp: float) -> int:
        return self._calls.delete_calls_finished_before(timestamp)

    def put_openai_file(self, file: OpenAIFileRecord) -> None:
        self._batches.put_openai_file(file)

    def get_openai_file(self, file_id: str) -> OpenAIFileRecord | None:
        return self._batches.get_openai_file(file_id)

    def list_openai_files(self, label: str, limit: int) -> list[OpenAIFileRecord]:
        return self._batches.list_openai_files(label, limit)

    def openai_files_of_workspace(self, workspace: str) -> list[str]:
        return self._batches.openai_files_of_workspace(workspace)

    def delete_openai_file(self, file_id: str) -> bool:
        return self._batches.delete_openai_file(file_id)

    def put_batch(self, batch: BatchRecord) -> None:
        self._batches.put_batch(batch)

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        return self._batches.get_batch(batch_id)

    def list_batches(self, label: str, limit: int) -> list[BatchRecord]:
        return self._batches.list_batches(label, limit)

    def unfinished_batches(self) -> list[BatchRecord]:
        return self._batches.unfinished_batches()

    def put_usage(self, usage: ReplicaUsage) -> None:
        self._usage.put_usage(usage)

    def add_token_usage(self, usage: TokenUsage) -> None:
        self._usage.add_token_usage(usage)

    def token_usage_since(self, timestamp: float) -> list[TokenUsage]:
        return self._usage.token_usage_since(timestamp)

    def usage_since(self, timestamp: float) -> list[ReplicaUsage]:
        return self._usage.usage_since(timestamp)

    def delete_usage_before(self, timestamp: float) -> int:
        return self._usage.delete_usage_before(timestamp)

    def put_snapshot(self, snapshot: SnapshotRecord) -> None:
        self._snapshots.put_snapshot(snapshot)

    def list_snapshots(self) -> list[SnapshotRecord]:
        return self._snapshots.list_snapshots()

    def delete_snapshot(self, key: str) -> None:
        self._snapshots.delete_snapshot(key)

    def dict_get(self, app: str, name: str, key: str, now: float) -> bytes | None:
        return self._shared_state.dict_get(app, name, key, now)

    def dict_put(
        self, app: str, name: str, key: str, value: bytes, expires_at: float | None
    ) -> None:
        self._shared_state.dict_put(app, name, key, value, expires_at)

    def dict_delete(self, app: str, name: str, key: str, now: float) -> bytes | None:
        return self._shared_state.dict_delete(app, name, key, now)

    def dict_keys(
        self, app: str, name: str, now: float, limit: int, after: str | None = None
    ) -> list[str]:
        return self._shared_state.dict_keys(app, name, now, limit, after)

    def dict_count(self, app: str, name: str, now: float) -> int:
        return self._shared_state.dict_count(app, name, now)

    def dict_clear(self, app: str, name: str) -> int:
        return self._shared_state.dict_clear(app, name)

    def delete_expired_items(self, now: float) -> int:
        return self._shared_state.delete_expired_items(now)

    def queue_put(self, app: str, name: str, values: list[bytes]) -> None:
        self._shared_state.queue_put(app, name, values)

    def queue_take(self, app: str, name: str, most: int) -> list[bytes]:
        return self._shared_state.queue_take(app, name, most)

    def queue_length(self, app: str, name: str) -> int:
        return self._shared_state.queue_length(app, name)

    def queue_clear(self, app: str, name: str) -> int:
        return self._shared_state.queue_clear(app, name)

    def volume_files(
        self,
        app: str,
        volume: str,
        prefix: str = "",
        after: str | None = None,
        limit: int | None = None,
    ) -> list[VolumeFile]:
        return self._volumes.volume_files(app, volume, prefix, after, limit)

    def volume_file(self, app: str, volume: str, path: str) -> VolumeFile | None:
        return self._volumes.volume_file(app, volume, path)

    def volume_put_file(self, app: str, volume: str, file: VolumeFile) -> None:
        self._volumes.volume_put_file(app, volume, file)

    def volume_remove(self, app: str, volume: str, paths: list[str]) -> None:
        self._volumes.volume_remove(app, volume, paths)

    def volumes(self, app: str) -> list[tuple[str, int, int]]:
        return self._volumes.volumes(app)

    def volume_digest_used(self, digest: str) -> bool:
        return self._volumes.volume_digest_used(digest)

    def blob_deletes(self) -> list[str]:
        return self._snapshots.blob_deletes()

    def add_blob_delete(self, key: str, failed_at: float) -> None:
        self._snapshots.add_blob_delete(key, failed_at)

    def remove_blob_delete(self, key: str) -> None:
        self._snapshots.remove_blob_delete(key)

    def close(self) -> None:
        self._db.close()
