"""Durable records the control plane keeps in its state store."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class CallStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (CallStatus.SUCCEEDED, CallStatus.FAILED)


@dataclass
class Deployment:
    app: str
    version: int
    bundle_digest: str
    manifest: dict  # AppManifest.to_dict()
    created_at: float
    # A canary's share of its endpoints' calls (1 to 99), while it is one; None for a
    # version deployed to serve them all (or a canary promoted to).
    canary_percent: int | None = None
    withdrawn: bool = False  # a canary aborted, or replaced before it was promoted


@dataclass
class ScalingOverride:
    """Autoscaling settings changed for one endpoint's version (`ember scale`)."""

    label: str
    app: str
    version: int  # it holds for this version only: a deploy ends it
    settings: dict  # setting -> value, of `scaling_overrides.SCALABLE`
    updated_at: float


@dataclass
class SnapshotRecord:
    """A process image in the blob store, ready to restore replicas from."""

    key: str
    label: str
    bundle_digest: str
    env_key: str  # the worker environment it was taken in
    size: int  # compressed bytes in the blob store
    raw_size: int
    dump_seconds: float
    created_at: float
    # Which dump of the key this is: a key dropped and taken again (`ember snapshot rm`,
    # a restore that failed) gets a new image, and nodes must not restore the old one.
    image_id: str = ""
    restores: int = 0  # replicas restored from it
    last_restored_at: float | None = None
    last_restore_seconds: float | None = None  # from placement to ready, the last time


@dataclass(frozen=True)
class SecretRecord:
    name: str
    values: dict[str, str]  # environment variables a replica gets: name -> value
    updated_at: float


@dataclass(frozen=True)
class TokenRecord:
    token_hash: str  # sha256 hex of the token; the token itself is never stored
    scope: str  # "admin", "deploy", "invoke", "worker" or "metrics"
    name: str
    created_at: float
    app: str | None = None  # an invoke token for this app's endpoints only
    rate_limit: str | None = None  # calls it may make, as "600/min" (`rate_limits`)
    expires_at: float | None = None  # Unix time it stops working at; None: never
    workspace: str | None = None  # of a deploy or invoke token (None before workspaces: main)


@dataclass(frozen=True)
class WorkspaceRecord:
    """A workspace made with `ember workspace create` (main is always there, unstored)."""

    name: str
    created_at: float


@dataclass(frozen=True)
class WorkspaceLimitsRecord:
    """An admin's admission limits for one workspace (`ember workspace set`); each None
    is the server's default (`ember server --workspace-max-queued ...`). main's too."""

    workspace: str
    max_queued: int | None = None  # inputs waiting in its endpoints' queues
    max_running: int | None = None  # calls on replicas at once
    rate: str | None = None  # calls accepted, as "100/s"; "none": no limit
    updated_at: float = 0.0

    @property
    def empty(self) -> bool:
        """Every limit is the default: no row to keep."""
        return self.max_queued is None and self.max_running is None and self.rate is None


@dataclass
class CallRecord:
    """An asynchronous call (`Prefer: respond-async`): kept until its result is collected."""

    id: str
    label: str
    method: str
    body: bytes
    status: CallStatus
    attempts: int
    created_at: float
    finished_at: float | None = None
    http_status: int | None = None
    result: bytes | None = None  # the response body: JSON, success or error, or a file
    media_type: str | None = None  # the result's (None: JSON, as before files were)
    filename: str | None = None  # a file result's name, if it has one
    webhook: str | None = None  # the URL told of its end (X-Ember-Webhook)
    # The webhook's delivery: None before the call ends, then WEBHOOK_PENDING, then
    # WEBHOOK_DELIVERED or WEBHOOK_FAILED.
    webhook_state: str | None = None


WEBHOOK_PENDING = "pending"
WEBHOOK_DELIVERED = "delivered"
WEBHOOK_FAILED = "failed"


@dataclass
class ReplicaUsage:
    """What one replica held, and for how long: the resources its endpoint reserves."""

    replica_id: str
    app: str
    endpoint: str
    gpu_type: str | None
    gpu_count: int
    cpu: float
    memory_mib: int
    start_kind: str | None  # "cold" or "restore"; None for one that never became ready
    inputs: int  # inputs it finished
    started_at: float
    ended_at: float


@dataclass(frozen=True)
class VolumeFile:
    """One file of an `ember.Volume`; its content is the blob of `digest` ("sha256:…")."""

    path: str
    digest: str
    size: int
    modified: float  # when it was written to the volume (Unix time)

    def to_json(self) -> dict[str, str | int | float]:
        return {
            "path": self.path,
            "digest": self.digest,
            "size": self.size,
            "modified": self.modified,
        }


@dataclass
class TokenUsage:
    """Tokens an endpoint's answers said, by traffic (online, batch): in a minute, or
    summed since `minute`."""

    app: str
    endpoint: str
    traffic: str
    minute: float
    input_tokens: int
    output_tokens: int
    requests: int


@dataclass
class OpenAIFileRecord:
    """A file of the OpenAI Batch API (an input, output or error file), of one endpoint."""

    id: str
    label: str
    purpose: str  # "batch" (uploaded), "batch_output" (made by a batch)
    filename: str
    bytes: int
    created_at: float


@dataclass
class BatchRecord:
    """A batch of the OpenAI Batch API: its OpenAI object as JSON, and its progress."""

    id: str
    label: str
    status: str  # OpenAI's: validating, in_progress, finalizing, completed, failed, ...
    document: str
    next_line: int  # the first line of its input file not yet submitted
    created_at: float
