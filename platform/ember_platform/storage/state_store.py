"""The state store interface: what any database behind the control plane must offer."""

from __future__ import annotations

from typing import Any, Protocol

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


class StoreWriteError(Exception):
    """A change the store could not record (its disk is full, or the database failed);
    none of it was kept. Every write method may raise it."""


class StoreUnavailableError(StoreWriteError):
    """The store's database cannot be reached now (a PostgreSQL server restarting, the
    network between): reads raise it too. It is tried again at the next use."""


class StateStore(Protocol):
    def claim_setting(self, name: str, value: str) -> str:
        """Record a platform setting unless it has a value already; the value that stands
        (the first start's, or another process's that claimed it first)."""
        ...

    def put_setting(self, name: str, value: str) -> None:
        """Record a platform setting, replacing the one recorded."""
        ...

    def put_deployment(self, deployment: Deployment) -> None: ...

    def latest_deployments(self) -> list[Deployment]:
        """The serving deployment of every app that is not stopped: its newest that is not
        a canary, nor withdrawn."""
        ...

    def list_deployments(self, app: str) -> list[Deployment]:
        """Every version of the app, stopped ones too, oldest first."""
        ...

    def canary_deployments(self) -> list[Deployment]:
        """The live canary of every app that has one (not promoted, withdrawn or stopped)."""
        ...

    def set_canary_percent(self, app: str, version: int, percent: int | None) -> None:
        """A canary's new share; None promotes it to serve every call."""
        ...

    def withdraw_deployment(self, app: str, version: int) -> None: ...

    def next_version(self, app: str) -> int: ...

    def delete_app(self, app: str) -> bool:
        """Stop the app: its deployments are kept for history, its overrides and last
        starts go."""
        ...

    def put_scaling_override(self, override: ScalingOverride) -> None: ...

    def list_scaling_overrides(self) -> list[ScalingOverride]: ...

    def delete_scaling_override(self, label: str) -> None: ...

    def put_endpoint_start(self, label: str, app: str, start: dict[str, Any], at: float) -> None:
        """An endpoint's last replica start (kind, total_seconds, phases), at `at`."""
        ...

    def endpoint_starts(self) -> dict[str, dict[str, Any]]:
        """label -> its last start, of the endpoints of every app not stopped."""
        ...

    def put_draining_node(self, name: str, since: float) -> None: ...

    def delete_draining_node(self, name: str) -> None: ...

    def list_draining_nodes(self) -> list[str]: ...

    def add_token(self, token: TokenRecord) -> None: ...

    def list_tokens(self) -> list[TokenRecord]: ...

    def put_secret(self, secret: SecretRecord) -> None:
        """Insert or replace a secret."""
        ...

    def list_secrets(self) -> list[SecretRecord]: ...

    def delete_secret(self, name: str) -> bool: ...

    def delete_token(self, token_hash: str) -> bool:
        """Forget a token, and the dashboard sessions it opened; False if there was none
        with that hash."""
        ...

    def put_dashboard_session(
        self, session_hash: str, token_hash: str, expires_at: float, created_at: float
    ) -> None:
        """Record a dashboard session (by the hash of its id) of a token."""
        ...

    def dashboard_session(self, session_hash: str) -> tuple[str, float] | None:
        """(the hash of its token, when it ends) of a recorded session, or None."""
        ...

    def delete_dashboard_sessions(self, session_hashes: list[str], ended_by: float) -> None:
        """Forget these sessions, and every one that ended by `ended_by`."""
        ...

    def put_workspace(self, workspace: WorkspaceRecord) -> None: ...

    def list_workspaces(self) -> list[WorkspaceRecord]: ...

    def delete_workspace(self, name: str) -> bool:
        """Forget a workspace and everything stored of it (apps' versions, calls, usage,
        Dicts, Queues, Volumes' files, snapshots' records, secrets, tokens, limits); False
        if there was none of that name."""
        ...

    def put_workspace_limits(self, limits: WorkspaceLimitsRecord) -> None:
        """Insert or replace a workspace's admission limits (all defaults: none kept)."""
        ...

    def list_workspace_limits(self) -> list[WorkspaceLimitsRecord]: ...

    def put_call(self, call: CallRecord) -> None:
        """Insert or replace an async call."""
        ...

    def get_call(self, call_id: str) -> CallRecord | None: ...

    def unfinished_calls(self) -> list[CallRecord]: ...

    def pending_webhooks(self) -> list[CallRecord]:
        """Ended calls whose webhook is still to be delivered."""
        ...

    def recent_calls(
        self,
        app: str | None,
        label: str | None,
        limit: int,
        workspace: str | None = MAIN_WORKSPACE,
    ) -> list[CallRecord]:
        """The newest calls, newest first: of one endpoint (`label`), of an app (its key),
        or of every app of `workspace` (None: of every workspace, the operator's view)."""
        ...

    def delete_calls_finished_before(self, timestamp: float) -> int: ...

    def put_openai_file(self, file: OpenAIFileRecord) -> None:
        """Insert or replace a Batch API file's record (its bytes are a blob)."""
        ...

    def get_openai_file(self, file_id: str) -> OpenAIFileRecord | None: ...

    def list_openai_files(self, label: str, limit: int) -> list[OpenAIFileRecord]:
        """An endpoint's files, newest first."""
        ...

    def openai_files_of_workspace(self, workspace: str) -> list[str]:
        """The ids of a workspace's Batch API files (not main's)."""
        ...

    def delete_openai_file(self, file_id: str) -> bool: ...

    def put_batch(self, batch: BatchRecord) -> None:
        """Insert or replace a batch."""
        ...

    def get_batch(self, batch_id: str) -> BatchRecord | None: ...

    def list_batches(self, label: str, limit: int) -> list[BatchRecord]:
        """An endpoint's batches, newest first."""
        ...

    def unfinished_batches(self) -> list[BatchRecord]:
        """The batches whose runner has work left, oldest first."""
        ...

    def add_token_usage(self, usage: TokenUsage) -> None:
        """Add tokens to an endpoint's count of a minute (online or batch traffic)."""
        ...

    def token_usage_since(self, timestamp: float) -> list[TokenUsage]:
        """Each endpoint's and traffic's tokens since then, summed."""
        ...

    def put_usage(self, usage: ReplicaUsage) -> None:
        """A replica that ended."""
        ...

    def usage_since(self, timestamp: float) -> list[ReplicaUsage]:
        """Replicas that ended at or after `timestamp`."""
        ...

    def delete_usage_before(self, timestamp: float) -> int: ...

    def put_snapshot(self, snapshot: SnapshotRecord) -> None: ...

    def list_snapshots(self) -> list[SnapshotRecord]: ...

    def delete_snapshot(self, key: str) -> None: ...

    # ember.Dict: a value per key (JSON text), with an optional expiry time.
    def dict_get(self, app: str, name: str, key: str, now: float) -> bytes | None: ...

    def dict_put(
        self, app: str, name: str, key: str, value: bytes, expires_at: float | None
    ) -> None: ...

    def dict_delete(self, app: str, name: str, key: str, now: float) -> bytes | None:
        """Remove the key; its value if it had a live one."""
        ...

    def dict_keys(
        self, app: str, name: str, now: float, limit: int, after: str | None = None
    ) -> list[str]: ...

    def dict_count(self, app: str, name: str, now: float) -> int: ...

    def dict_clear(self, app: str, name: str) -> int: ...

    def delete_expired_items(self, now: float) -> int: ...

    # ember.Queue: values (JSON text) first in, first out.
    def queue_put(self, app: str, name: str, values: list[bytes]) -> None:
        """Append all of them, or none (StoreWriteError)."""
        ...

    def queue_take(self, app: str, name: str, most: int) -> list[bytes]:
        """Remove and return up to `most` of the oldest values."""
        ...

    def queue_length(self, app: str, name: str) -> int: ...

    def queue_clear(self, app: str, name: str) -> int: ...

    # ember.Volume: files by path; their contents are blobs named by digest.
    def volume_files(
        self,
        app: str,
        volume: str,
        prefix: str = "",
        after: str | None = None,
        limit: int | None = None,
    ) -> list[VolumeFile]:
        """In path order; with `prefix`, that file or the files in that folder; with
        `after` and `limit`, a page of those past `after`."""
        ...

    def volume_file(self, app: str, volume: str, path: str) -> VolumeFile | None: ...

    def volume_put_file(self, app: str, volume: str, file: VolumeFile) -> None: ...

    def volume_remove(self, app: str, volume: str, paths: list[str]) -> None:
        """Remove all of them, or none (StoreWriteError)."""
        ...

    def volumes(self, app: str) -> list[tuple[str, int, int]]:
        """(name, files, bytes) of each of the app's volumes that holds a file."""
        ...

    def volume_digest_used(self, digest: str) -> bool:
        """Whether any file of any volume has this content (else its blob may go)."""
        ...

    # Blobs whose delete failed at the blob store (blob_deletes.py): sent again later.
    def blob_deletes(self) -> list[str]: ...

    def add_blob_delete(self, key: str, failed_at: float) -> None: ...

    def remove_blob_delete(self, key: str) -> None: ...

    def close(self) -> None: ...
