"""The control plane's configuration, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ember.errors import InvalidError
from ember.wire.labels import checked_domain
from ember_platform.limits.held_bytes import (
    DEFAULT_PLATFORM_MIB,
    DEFAULT_WORKSPACE_MIB,
    MIB,
    ByteBudgets,
)
from ember_platform.observability.prices import Prices, parse_prices
from ember_platform.security.rate_limits import parse_rate_limit


@dataclass
class ServerConfig:
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 8443  # 0 picks a free port
    domain: str | None = None  # wildcard domain: https://{label}.{domain}/
    local_worker: bool = True
    lazy_restore: bool = False  # the local worker restores snapshots lazily (opt-in)
    local_worker_gpus: str | None = None  # its --gpus (None: the GPUs nvidia-smi lists)
    local_worker_options: tuple[str, ...] = ()  # more `ember worker` flags, e.g. cache sizes
    max_body_bytes: int = 8 * 1024 * 1024
    # The OpenAI Batch API: an input file's bytes at most, and its requests.
    batch_file_bytes: int = 64 * 1024 * 1024
    batch_max_requests: int = 50_000
    # What one client may hold of the HTTPS gateway: a request line and headers of at most
    # this many bytes and headers (else 431), sent within head_timeout_seconds; an idle
    # keep-alive connection's seconds; connections at once, in all and from one address
    # (else 503).
    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    head_timeout_seconds: float = 10.0
    keep_alive_seconds: int = 5
    max_connections: int = 10_000
    max_connections_per_address: int = 1_000
    max_queue: int = 1000  # queued inputs per endpoint before 429
    # Each workspace's admission limits, unless an admin set its own (`ember workspace
    # set`): inputs queued over its endpoints, calls running at once, and calls accepted
    # per period ("100/s"; None: no limit). Past one its callers get 429.
    workspace_max_queued: int = 10_000
    workspace_max_running: int = 1_000
    workspace_rate: str | None = None
    # What replicas' resources cost (`--price cpu=0.04/h,...`): `ember usage`'s costs.
    price: str | None = None
    prices: Prices = field(default_factory=Prices, init=False)
    # MiB of calls' bodies, and of their results and stream events, held at once per
    # workspace and in all (limits/held_bytes.py): past them, callers wait.
    workspace_held_mb: int = DEFAULT_WORKSPACE_MIB
    max_held_mb: int = DEFAULT_PLATFORM_MIB
    tick_seconds: float = 0.05  # autoscaler and lease checks
    lease_seconds: float = 10.0  # a replica silent this long is presumed dead
    worker_lease_seconds: float = 15.0
    # How long to wait for workers to (re)connect before calling an endpoint unservable;
    # a worker's reconnect backoff tops out at 5 s.
    reconnect_grace_seconds: float = 6.0
    startup_timeout: float = 600.0  # a replica not ready by then is killed
    stop_grace_seconds: float = 30.0
    # A replica's channel closed: how long to wait for its worker to say why the process
    # ended (that reaches callers and logs) before losing it for the closed channel alone.
    exit_report_grace_seconds: float = 1.0
    call_retention_seconds: float = 24 * 3600.0
    snapshot_budget_bytes: int = 50 * 1024**3  # process images in the blob store
    log_level: str = "warning"
    # Spawned calls' webhooks: http:// receivers too (development only: the signed body
    # would travel in the clear), a CA to trust beside the system's, and the seconds
    # before each retry.
    webhook_allow_http: bool = False
    webhook_ca_cert: Path | None = None
    webhook_retry_delays: tuple[float, ...] = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0)
    # Requests' spans to an OpenTelemetry collector (OTLP/HTTP, JSON): its base URL
    # (else $OTEL_EXPORTER_OTLP_ENDPOINT), headers (e.g. its API key), a CA to trust.
    otlp_endpoint: str | None = None
    otlp_headers: dict[str, str] = field(default_factory=dict)
    otlp_ca_cert: Path | None = None
    # The operator's certificate chain and key, served to callers who ask for a name it
    # covers (the platform's own CA's certificate to every other caller).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Where callers reach the platform, when not at https://HOST:PORT (a load balancer, a
    # port mapping): the endpoints' URLs it prints and webhook payloads' `status_url`.
    public_url: str | None = None
    # Where bundles, snapshot images and volume files live: an s3:// URL (a bucket and an
    # optional prefix, reached with the AWS settings of the server's environment and
    # `blob_s3_endpoint_url` for another S3 API); None: `blob_dir`, on this machine.
    blob_store: str | None = None
    blob_s3_endpoint_url: str | None = None
    # This start moves the platform to `blob_store`: recorded as the database's store in
    # place of the one recorded before (else a server on another store is refused).
    move_blob_store: bool = False
    # Where the state store keeps its tables: a postgresql:// URL; None: SQLite, `db_path`.
    database: str | None = None
    # With a database, several processes may serve one platform: the one holding its
    # lease owns it (renewed every ttl/8 on the database's clock, given up a quarter of
    # the ttl before it runs out), the others pipe their connections to its
    # `advertise_url` (default: this process's https://HOST:PORT), a new one waiting up
    # to `standby_hold_seconds` for an owner while there is none.
    advertise_url: str | None = None
    lease_ttl_seconds: float = 2.0
    standby_hold_seconds: float = 10.0

    def __post_init__(self) -> None:
        # One spelling (lower-case A-labels) for the certificate, routing and URLs; a
        # domain no host can have (a port in it, say) is refused here.
        if self.domain is not None:
            self.domain = checked_domain(self.domain)
        if self.price is not None:
            try:
                self.prices = parse_prices(self.price)
            except ValueError as exc:
                raise InvalidError(f"--price: {exc}") from None
        if self.workspace_rate is not None:
            try:
                self.workspace_rate = str(parse_rate_limit(self.workspace_rate))
            except ValueError as exc:
                raise InvalidError(f"--workspace-rate: {exc}") from None
        for flag, count in (
            ("--workspace-max-queued", self.workspace_max_queued),
            ("--workspace-max-running", self.workspace_max_running),
        ):
            if count < 1:
                raise InvalidError(f"{flag} is at least 1, not {count}")

    @property
    def held_budgets(self) -> ByteBudgets:
        return ByteBudgets(self.workspace_held_mb * MIB, self.max_held_mb * MIB)

    @property
    def db_path(self) -> Path:
        return self.state_dir / "state.db"

    @property
    def blob_dir(self) -> Path:
        return self.state_dir / "blobs"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def worker_dir(self) -> Path:
        return self.state_dir / "worker"
