"""A client config that is broken (a CA file that is not there, a file that is not a JSON
object) is a ConfigError saying which file or variable, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.calling.tlsclient import client_context
from ember.config import load_config
from ember.errors import ConfigError
from ember.wire.labels import REPLICA_LABEL_ENV


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config.json"
    monkeypatch.setenv("EMBER_CONFIG", str(path))
    for name in ("EMBER_SERVER_URL", "EMBER_TOKEN", "EMBER_CA_CERT", REPLICA_LABEL_ENV):
        monkeypatch.delenv(name, raising=False)
    return path


def _write(path: Path, **fields: str) -> None:
    path.write_text(json.dumps({"server_url": "https://127.0.0.1:1", "token": "emb_t", **fields}))


def test_a_config_file_that_is_not_an_object_names_the_file(config_file: Path) -> None:
    config_file.write_text("[]")
    with pytest.raises(ConfigError, match=f"{config_file} holds a JSON list, not an object"):
        load_config()


def test_a_missing_ca_cert_in_the_file_names_the_file(config_file: Path, tmp_path: Path) -> None:
    _write(config_file, ca_cert=str(tmp_path / "gone.pem"))
    with pytest.raises(ConfigError, match=f"the ca_cert of {config_file} names .*gone.pem"):
        load_config()


def test_a_missing_ca_cert_in_the_variable_names_the_variable(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(config_file)
    monkeypatch.setenv("EMBER_CA_CERT", str(tmp_path / "gone.pem"))
    with pytest.raises(ConfigError, match=r"EMBER_CA_CERT names .*gone\.pem, which is not a file"):
        load_config()


def test_a_ca_cert_that_is_not_pem_is_a_config_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"cannot load the CA certificate {junk}"):
        client_context(str(junk))
