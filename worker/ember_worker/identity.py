"""What a replica process is told about itself.

Two parts: the static spec, in the environment (the same for every replica of an
endpoint version, so it may be frozen into a snapshot), and the identity of this one
replica (id, credentials, where the control plane is), written by the agent into a
control pipe. A process restored from a snapshot reads its identity from that pipe,
never from the environment frozen in the image.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ember.state.volume_paths import VOLUMES_DIR_ENV
from ember.wire.labels import REPLICA_LABEL_ENV

# The weights cache a replica's `open_weights` uses (ember_worker.weights.opener).
WEIGHTS_CACHE_DIR_ENV = "EMBER_WEIGHTS_CACHE"
WEIGHTS_CACHE_BYTES_ENV = "EMBER_WEIGHTS_CACHE_BYTES"

ENV_PREFIX = "EMBER_REPLICA_"
WORKDIR_ENV = ENV_PREFIX + "WORKDIR"  # an image's working folder: where the replica starts


@dataclass(frozen=True)
class ReplicaSpec:
    bundle_dir: Path
    entry: str
    attribute: str
    concurrency: int
    label: str
    control_fd: int  # read: identity lines from the agent
    status_fd: int  # write: lifecycle events for the agent ("quiet")

    def to_env(self) -> dict[str, str]:
        return {
            ENV_PREFIX + "BUNDLE_DIR": str(self.bundle_dir),
            ENV_PREFIX + "ENTRY": self.entry,
            ENV_PREFIX + "ATTRIBUTE": self.attribute,
            ENV_PREFIX + "CONCURRENCY": str(self.concurrency),
            REPLICA_LABEL_ENV: self.label,
            ENV_PREFIX + "CONTROL_FD": str(self.control_fd),
            ENV_PREFIX + "STATUS_FD": str(self.status_fd),
        }

    @classmethod
    def from_env(cls) -> ReplicaSpec:
        env = os.environ
        return cls(
            bundle_dir=Path(env[ENV_PREFIX + "BUNDLE_DIR"]),
            entry=env[ENV_PREFIX + "ENTRY"],
            attribute=env[ENV_PREFIX + "ATTRIBUTE"],
            concurrency=int(env[ENV_PREFIX + "CONCURRENCY"]),
            label=env[REPLICA_LABEL_ENV],
            control_fd=int(env[ENV_PREFIX + "CONTROL_FD"]),
            status_fd=int(env[ENV_PREFIX + "STATUS_FD"]),
        )


@dataclass(frozen=True)
class ReplicaIdentity:
    replica_id: str
    token: str  # opens the replica's channel
    server_url: str
    ca_cert: str | None
    # An invoke token for the user's code, so that it can call other endpoints with the
    # SDK (given to it as EMBER_TOKEN, see `client_environment`).
    call_token: str = ""
    # Every process of the platform the node was given (`--server a,b`): where the
    # channel is tried again, in turn, when it closes (an owner died).
    server_urls: list[str] = field(default_factory=list)
    # The control plane's Unix socket on this node, if it has one: the channel's way in.
    channel_socket: str | None = None
    # The node's folder of ember.Volume copies (EMBER_VOLUMES_DIR): after a restore, this
    # node's, not the snapshot's.
    volumes_dir: str | None = None
    # The node's weights cache (EMBER_WEIGHTS_CACHE and its size): likewise this node's
    # after a restore, so weights opened then go into its cache, not the snapshot node's.
    weights_cache_dir: str | None = None
    weights_cache_bytes: int | None = None
    restored: bool = False  # this process was restored from a snapshot
    fetch_seconds: float = 0.0  # the agent fetching the image (0 when cached on the node)
    restore_seconds: float = 0.0  # CRIU restoring the process
    # Of that, the CUDA driver putting device memory back (None: no GPU state).
    gpu_restore_seconds: float | None = None
    # A lazy restore: memory still arrives while the process runs (the control plane
    # holds back this replica's outputs until the agent reports all of it in).
    memory_pending: bool = False
    # A restored process's environment names the GPUs of the snapshot's replica: these
    # are this one's (None on nodes without GPUs).
    cuda_visible_devices: str | None = None
    # The endpoint's secrets, as now: a restored process's environment is the snapshot's.
    env: dict[str, str] | None = None
    # Its private working area (HOME, TMPDIR under it): a restored process's environment
    # names the snapshot's replica's.
    home: str | None = None
    # "UID:GID" it serves as: one that runs as root (it was dumped, or restored from an
    # image, before replicas had /proc of their own) gives up root once it reads this.
    user: str | None = None
    # Its PID as the node sees it (its own /proc shows 1 in a sandbox): EMBER_REPLICA_PID.
    replica_pid: int | None = None
    # How the node made the root of its image= ("lazy", or "extracted (why)"); "" without.
    image_root: str = ""

    def working_area(self) -> dict[str, str]:
        """HOME and TMPDIR of this replica, where it has a working area of its own."""
        if not self.home:
            return {}
        return {"HOME": self.home, "TMPDIR": os.path.join(self.home, "tmp")}

    def client_environment(self) -> dict[str, str]:
        """What the SDK's `load_config` reads, so that `ember.Endpoint.lookup` in the
        replica's code reaches this platform as this replica, whatever config file the
        node's user has."""
        # Every process of the platform, where the node has several: its code's calls go
        # on through another when one dies, as its channel does.
        servers = ",".join(self.server_urls) if len(self.server_urls) > 1 else self.server_url
        env = {"EMBER_SERVER_URL": servers, "EMBER_TOKEN": self.call_token}
        if self.ca_cert:
            env["EMBER_CA_CERT"] = self.ca_cert
        if self.volumes_dir:
            env[VOLUMES_DIR_ENV] = self.volumes_dir
        if self.weights_cache_dir:
            env[WEIGHTS_CACHE_DIR_ENV] = self.weights_cache_dir
        if self.weights_cache_bytes:
            env[WEIGHTS_CACHE_BYTES_ENV] = str(self.weights_cache_bytes)
        return env

    def to_line(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaIdentity:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def read_line(fd: int) -> bytes:
    """One line from a pipe, byte by byte so nothing after it is consumed."""
    data = bytearray()
    while True:
        chunk = os.read(fd, 1)
        if not chunk:
            raise EOFError("the agent closed the control pipe")
        if chunk == b"\n":
            return bytes(data)
        data += chunk
