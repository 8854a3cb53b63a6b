"""The client configuration that `ember server` writes and every other command reads."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ember.errors import ConfigError
from ember.wire.labels import REPLICA_LABEL_ENV


def config_path() -> Path:
    explicit = os.environ.get("EMBER_CONFIG")
    if explicit:
        return Path(explicit)
    return Path.home() / ".ember" / "config.json"


@dataclass(frozen=True)
class ClientConfig:
    server_url: str  # e.g. https://127.0.0.1:8443
    token: str
    ca_cert: str | None = None  # PEM file to trust; None means the system's CAs
    domain: str | None = None
    # The workspace an admin token acts in (EMBER_WORKSPACE; main if None). A deploy or
    # invoke token acts in its own, whatever this says.
    workspace: str | None = None
    # Every server of a platform of several processes (`EMBER_SERVER_URL=https://a,https://b`),
    # tried in turn when one cannot be reached; `server_url` is the first.
    server_urls: tuple[str, ...] = ()


def server_list(text: str) -> tuple[str, ...]:
    """The URLs of a comma-separated list (one URL: itself)."""
    return tuple(url.strip() for url in text.split(",") if url.strip())


def load_config() -> ClientConfig:
    """Read the config file, then let EMBER_SERVER_URL / EMBER_TOKEN / EMBER_CA_CERT override.

    In a replica only the variables count: the platform sets them to its address and the
    replica's own invoke token, and the node user's file (maybe with an admin token) is
    not the replica's to use."""
    data: dict[str, str | None] = {}
    path = config_path()
    if path.exists() and not os.environ.get(REPLICA_LABEL_ENV):
        data = _read_config_file(path)
    ca_cert_source = f"the ca_cert of {path}"
    for key, env in (
        ("server_url", "EMBER_SERVER_URL"),
        ("token", "EMBER_TOKEN"),
        ("ca_cert", "EMBER_CA_CERT"),
        ("workspace", "EMBER_WORKSPACE"),
    ):
        if os.environ.get(env):
            data[key] = os.environ[env]
            if key == "ca_cert":
                ca_cert_source = "EMBER_CA_CERT"
    if data.get("ca_cert") and not os.path.isfile(str(data["ca_cert"])):
        raise ConfigError(
            f"{ca_cert_source} names {data['ca_cert']}, which is not a file: point it at "
            "the server's CA certificate (ca.pem in the state dir of `ember server`), or "
            "unset it to trust the system's CAs"
        )
    if not server_list(str(data.get("server_url") or "")) or not data.get("token"):
        raise ConfigError(
            f"no Ember server configured: run `ember server` on this machine (it writes {path}) "
            "or set EMBER_SERVER_URL and EMBER_TOKEN"
        )
    servers = server_list(str(data["server_url"]))
    return ClientConfig(
        server_url=servers[0],
        server_urls=servers if len(servers) > 1 else (),
        token=str(data["token"]),
        ca_cert=data.get("ca_cert"),
        domain=data.get("domain"),
        workspace=data.get("workspace") or None,
    )


def _read_config_file(path: Path) -> dict[str, str | None]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the Ember client config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"the Ember client config {path} holds a JSON {type(data).__name__}, not an "
            'object like {"server_url": ..., "token": ...}: fix it, or remove it and run '
            "`ember server` to write it again"
        )
    return data


def save_config(config: ClientConfig) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        data = asdict(config)
        servers = data.pop("server_urls")
        if servers:
            data["server_url"] = ",".join(servers)
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)
    return path
