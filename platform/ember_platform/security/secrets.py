"""Secrets: named sets of environment variables that endpoints ask for with
`@ember.endpoint(secrets=[...])` and replicas get in their environment.

Values live in the state store (a file only the server's user can read) and in memory,
and go to a worker only in the start command of a replica that needs them. A listing
shows names and keys, never values. Snapshot keys include a digest of the values
(`env_digest`), so a replica never restores an image whose memory holds old values.
"""

from __future__ import annotations

import hashlib
import json
import time

from ember.declarations.settings import EndpointSettings, check_environment, check_name
from ember.errors import InvalidError
from ember.wire.labels import app_key, split_app_key
from ember_platform.storage.records import SecretRecord
from ember_platform.storage.state_store import StateStore


def check_values(name: str, values: object) -> dict[str, str]:
    """The secret's variables if they can be a replica's environment, else InvalidError."""
    check_name("secret", name)
    if not isinstance(values, dict) or not values:
        raise InvalidError(f"secret {name} needs at least one KEY=VALUE")
    return check_environment(f"secret {name}", values)


class SecretRegistry:
    """The secrets, in memory; the store is written first on every change. A secret
    belongs to a workspace and is stored under the key `app_key(workspace, name)`."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._secrets = {s.name: s for s in store.list_secrets()}

    def put(self, workspace: str, name: str, values: object) -> bool:
        """Create or replace a secret (InvalidError for bad values); True if it is new."""
        checked = check_values(name, values)
        key = app_key(workspace, name)
        record = SecretRecord(key, checked, time.time())
        self._store.put_secret(record)
        created = key not in self._secrets
        self._secrets[key] = record
        return created

    def delete(self, workspace: str, name: str) -> bool:
        key = app_key(workspace, name)
        if key not in self._secrets:
            return False
        self._store.delete_secret(key)
        del self._secrets[key]
        return True

    def all(self, workspace: str) -> list[tuple[str, SecretRecord]]:
        """(name, record) of the workspace's secrets, by name."""
        mine = [
            (split_app_key(key)[1], record)
            for key, record in self._secrets.items()
            if split_app_key(key)[0] == workspace
        ]
        return sorted(mine, key=lambda pair: pair[0])

    def missing(self, workspace: str, names: list[str]) -> list[str]:
        return [n for n in names if app_key(workspace, n) not in self._secrets]

    def replica_env(self, workspace: str, settings: EndpointSettings) -> dict[str, str]:
        """A replica's environment: its endpoint's own variables, then its secrets'
        (which win), from the endpoint's workspace."""
        return {**settings.env, **self.env_for(workspace, settings.secrets)}

    def env_for(self, workspace: str, names: list[str]) -> dict[str, str]:
        """The variables of the named secrets (existing ones), later names winning."""
        env: dict[str, str] = {}
        for name in names:
            record = self._secrets.get(app_key(workspace, name))
            if record is not None:
                env.update(record.values)
        return env


def env_digest(env: dict[str, str]) -> str:
    """Changes whenever the variables do; '' for none (keys of endpoints without secrets
    stay as they were)."""
    if not env:
        return ""
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()
