"""What a replica process is told about itself, through its environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "EMBER_REPLICA_"


@dataclass(frozen=True)
class ReplicaIdentity:
    replica_id: str
    token: str
    server_url: str
    ca_cert: str | None
    bundle_dir: Path
    entry: str
    attribute: str
    concurrency: int
    label: str

    def to_env(self) -> dict[str, str]:
        return {
            ENV_PREFIX + "ID": self.replica_id,
            ENV_PREFIX + "TOKEN": self.token,
            ENV_PREFIX + "SERVER_URL": self.server_url,
            ENV_PREFIX + "CA_CERT": self.ca_cert or "",
            ENV_PREFIX + "BUNDLE_DIR": str(self.bundle_dir),
            ENV_PREFIX + "ENTRY": self.entry,
            ENV_PREFIX + "ATTRIBUTE": self.attribute,
            ENV_PREFIX + "CONCURRENCY": str(self.concurrency),
            ENV_PREFIX + "LABEL": self.label,
        }

    @classmethod
    def from_env(cls) -> ReplicaIdentity:
        env = os.environ
        return cls(
            replica_id=env[ENV_PREFIX + "ID"],
            token=env[ENV_PREFIX + "TOKEN"],
            server_url=env[ENV_PREFIX + "SERVER_URL"],
            ca_cert=env.get(ENV_PREFIX + "CA_CERT") or None,
            bundle_dir=Path(env[ENV_PREFIX + "BUNDLE_DIR"]),
            entry=env[ENV_PREFIX + "ENTRY"],
            attribute=env[ENV_PREFIX + "ATTRIBUTE"],
            concurrency=int(env[ENV_PREFIX + "CONCURRENCY"]),
            label=env[ENV_PREFIX + "LABEL"],
        )
