"""The worker's settings, from `ember worker`'s arguments: where the control plane is,
what this node offers, and where it keeps its caches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ember_worker.log_limits import LogLimit
from ember_worker.processes.replica_users import DEFAULT_FIRST_UID, DEFAULT_UID_COUNT
from ember_worker.resources import GpuDevice

WEIGHTS_DIR = "weights"  # the node's weights cache, in the work dir


@dataclass
class AgentConfig:
    server_url: str  # the one used now: the first of `server_urls`, or the next that answers
    token: str
    ca_cert: str | None
    work_dir: Path
    name: str
    cpu: float
    memory: int
    gpus: list[GpuDevice] = field(default_factory=list)  # detected or declared (--gpus)
    snapshot_budget_bytes: int = 20 * 1024**3  # node-local snapshot images
    weights_cache_bytes: int = 50 * 1024**3  # node-local weights chunks, shared by replicas
    volume_cache_bytes: int = 50 * 1024**3  # node-local ember.Volume copies
    bundle_cache_bytes: int = 2 * 1024**3  # extracted app bundles no replica uses
    image_roots_bytes: int = 20 * 1024**3  # extracted image roots no replica uses
    # Restored replicas run before all their memory is back (where the kernel allows).
    # Opt-in: should CRIU's lazy-pages daemon die, the replica would read zeroed pages in
    # the moment before it is killed; eager restores cannot fail that way.
    lazy_restore: bool = False
    # Restored replicas' dense memory goes into 2 MiB pages (huge_pages.py). Opt-in: a
    # win where the kernel has huge pages at hand, a loss on VMs whose host takes free
    # memory back.
    huge_pages: bool = False
    fetch_ahead: bool = True  # published images, before a replica here needs them
    # The control plane's Unix socket, when it runs on this node: channels skip TCP and TLS.
    channel_socket: str | None = None
    # The socket file sandboxed replicas' channels use instead (--replica-channel-socket).
    replica_channel_socket: str | None = None
    labels: dict[str, str] = field(default_factory=dict)  # for endpoints' node_labels=
    # On SIGTERM, how long replicas may take to finish their inputs before they are
    # stopped anyway (a second signal stops them at once).
    shutdown_grace: float = 30.0
    # The uids replicas run as (one per workspace): first, count (--replica-uids).
    replica_uids: tuple[int, int] = (DEFAULT_FIRST_UID, DEFAULT_UID_COUNT)
    # Every URL given (`--server https://a,https://b`): processes of one platform, any of
    # which passes the channel on to the one that owns it. Tried in turn when one fails.
    server_urls: tuple[str, ...] = ()

    def next_server(self) -> str:
        """Move `server_url` on to the next of `server_urls` (the channels and the
        replicas started from now on use it)."""
        if len(self.server_urls) > 1:
            at = (
                self.server_urls.index(self.server_url)
                if self.server_url in self.server_urls
                else -1
            )
            self.server_url = self.server_urls[(at + 1) % len(self.server_urls)]
        return self.server_url

    # A replica cgroup's pids.max: the processes and threads it may have at once.
    replica_pids_max: int = 4096
    # Replicas in their own mount, IPC and UTS namespaces under a seccomp filter, where
    # the worker is root (--no-sandbox: off, for benchmarks and debugging).
    sandbox: bool = True
    # Folders of the node every replica may read (--model-dir), read-only in sandboxes.
    model_dirs: tuple[str, ...] = ()
    # Variables of the worker's environment handed on to every replica (--replica-env);
    # nothing else of it reaches one.
    replica_env: tuple[str, ...] = ()
    # Seconds an image build step may run before it is killed and fails (--build-step-timeout).
    build_step_timeout: float = 30 * 60.0
    # Ports of the node's loopback every sandboxed replica reaches on its own
    # (--replica-loopback-port): services the operator runs on the node for them.
    loopback_ports: tuple[int, ...] = ()
    # Each replica's output shipped to its log: a rate and burst (--log-rate, --log-burst).
    log_limit: LogLimit = field(default_factory=LogLimit)

    @property
    def volumes_dir(self) -> str:
        """The node's ember.Volume copies, shared by its replicas of each app."""
        return str(self.work_dir / "volumes")

    @property
    def weights_dir(self) -> Path:
        """The node's weights cache, shared by its replicas (the readers' disk tier)."""
        return self.work_dir / WEIGHTS_DIR
