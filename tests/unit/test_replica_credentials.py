"""What a replica's code is given to call the platform (its address and an invoke token
of its own, never the node user's config file), and the client the SDK keeps for calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ember
from ember.config import load_config
from ember.wire.labels import REPLICA_LABEL_ENV, current_app
from ember_worker.identity import ReplicaIdentity


def _identity(ca_cert: str | None) -> ReplicaIdentity:
    return ReplicaIdentity(
        replica_id="r-1",
        token="channel-secret",
        call_token="emb_invoke",
        server_url="https://10.0.0.1:8443",
        ca_cert=ca_cert,
    )


def test_client_environment_names_the_call_token_not_the_channel_token() -> None:
    env = _identity("/etc/ember/ca.pem").client_environment()
    assert env == {
        "EMBER_SERVER_URL": "https://10.0.0.1:8443",
        "EMBER_TOKEN": "emb_invoke",
        "EMBER_CA_CERT": "/etc/ember/ca.pem",
    }
    assert "EMBER_CA_CERT" not in _identity(None).client_environment()  # the system's CAs


def test_an_identity_line_from_an_older_agent_still_reads() -> None:
    line = json.loads(_identity(None).to_line())
    del line["call_token"]
    assert ReplicaIdentity.from_dict(line).call_token == ""


def test_current_app_comes_from_the_replica_label(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPLICA_LABEL_ENV, raising=False)
    assert current_app() is None
    monkeypatch.setenv(REPLICA_LABEL_ENV, "shop--recommend")
    assert current_app() == "shop" == ember.current_app()
    monkeypatch.setenv(REPLICA_LABEL_ENV, "not a label")
    assert current_app() is None


def test_in_a_replica_only_the_variables_configure_the_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"server_url": "https://admin:1", "token": "emb_admin"}))
    monkeypatch.setenv("EMBER_CONFIG", str(config_file))
    for name in ("EMBER_SERVER_URL", "EMBER_TOKEN", "EMBER_CA_CERT", REPLICA_LABEL_ENV):
        monkeypatch.delenv(name, raising=False)
    assert load_config().token == "emb_admin"  # on the user's machine, the file counts
    monkeypatch.setenv(REPLICA_LABEL_ENV, "shop--recommend")
    with pytest.raises(ember.ConfigError):
        load_config()  # a replica never falls back on the node user's token
    monkeypatch.setenv("EMBER_SERVER_URL", "https://10.0.0.1:8443")
    monkeypatch.setenv("EMBER_TOKEN", "emb_invoke")
    config = load_config()
    assert (config.server_url, config.token, config.ca_cert) == (
        "https://10.0.0.1:8443",
        "emb_invoke",
        None,
    )


def test_deployed_needs_an_app_outside_a_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPLICA_LABEL_ENV, raising=False)

    @ember.endpoint()
    def square(x: int) -> int:
        return x * x

    with pytest.raises(ember.InvalidError, match="needs app="):
        square.deployed()


def test_calls_share_a_client_per_platform_and_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.calling.connections import _shared, close_shared_clients, shared_client
    from ember.config import ClientConfig

    close_shared_clients()
    one = ClientConfig("https://127.0.0.1:1", "emb_a")
    first = shared_client(one)
    assert shared_client(ClientConfig("https://127.0.0.1:1", "emb_a")) is first
    assert shared_client(ClientConfig("https://127.0.0.1:1", "emb_b")) is not first
    # A forked child makes its own, and leaves its parent's connections alone.
    monkeypatch.setattr("os.getpid", lambda: -1)
    child = shared_client(one)
    assert child is not first
    close_shared_clients()
    assert child.is_closed and not first.is_closed and not _shared
    first.close()
