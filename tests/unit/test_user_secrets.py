"""Secrets: checked values, the registry over the store, and what replicas get."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from store_backends import StoreOpener

from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember_platform.security.secrets import SecretRegistry, check_values, env_digest
from ember_platform.storage.sqlite_store import SqliteStateStore


@pytest.fixture
def store(tmp_path: Path):
    store = SqliteStateStore(tmp_path / "state.db")
    yield store
    store.close()


def test_the_state_database_is_for_the_servers_user_alone(
    store: SqliteStateStore, tmp_path: Path
) -> None:
    assert stat.S_IMODE((tmp_path / "state.db").stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "at least one KEY=VALUE"),
        ("A=1", "at least one KEY=VALUE"),
        ({"1A": "x"}, "not an environment variable name"),
        ({"A-B": "x"}, "not an environment variable name"),
        ({"A\\nB": "x"}, "not an environment variable name"),
        ({"ember_token": "x"}, "are Ember's own"),
        ({"A": 1}, "must be text"),
        ({"A": "x\0y"}, "must be text without NUL"),
        ({"A": "x" * (64 * 1024 + 1)}, "at most 65536"),
        ({f"K{i}": "v" for i in range(101)}, "at most 100"),
        ({f"K{i}": "v" * 60_000 for i in range(5)}, "at most 262144"),
    ],
)
def test_bad_values_are_refused(values: object, message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        check_values("s", values)


def test_the_registry_keeps_secrets_across_restarts(open_store: StoreOpener) -> None:
    store = open_store()
    secrets = SecretRegistry(store)
    assert secrets.put("main", "openai", {"OPENAI_API_KEY": "k1", "ORG": "o"}) is True
    assert secrets.put("main", "db", {"DB_URL": "postgres://", "ORG": "from-db"}) is True
    assert secrets.put("main", "openai", {"OPENAI_API_KEY": "k2", "ORG": "o"}) is False
    assert secrets.missing("main", ["openai", "nope", "db"]) == ["nope"]
    # Later names win where keys meet; unknown names add nothing.
    assert secrets.env_for("main", ["openai", "db", "nope"]) == {
        "OPENAI_API_KEY": "k2",
        "ORG": "from-db",
        "DB_URL": "postgres://",
    }
    again = SecretRegistry(open_store())  # as after a restart
    assert [name for name, _ in again.all("main")] == ["db", "openai"]
    assert again.env_for("main", ["openai"]) == {"OPENAI_API_KEY": "k2", "ORG": "o"}
    assert again.delete("main", "db") and not again.delete("main", "db")
    assert [name for name, _ in SecretRegistry(store).all("main")] == ["openai"]


def test_a_secret_is_its_workspace_s_alone(open_store: StoreOpener) -> None:
    secrets = SecretRegistry(open_store())
    secrets.put("main", "openai", {"KEY": "main's"})
    secrets.put("team", "openai", {"KEY": "team's"})
    assert secrets.env_for("team", ["openai"]) == {"KEY": "team's"}
    assert secrets.env_for("main", ["openai"]) == {"KEY": "main's"}
    assert secrets.missing("other", ["openai"]) == ["openai"]
    assert [name for name, _ in secrets.all("team")] == ["openai"]
    assert secrets.all("other") == []
    assert secrets.delete("team", "openai") and secrets.env_for("main", ["openai"])


def test_the_digest_follows_the_values(store: SqliteStateStore) -> None:
    secrets = SecretRegistry(store)
    assert env_digest(secrets.env_for("main", [])) == ""
    secrets.put("main", "a", {"X": "1"})
    before = env_digest(secrets.env_for("main", ["a"]))
    assert before and env_digest(secrets.env_for("main", ["a"])) == before
    secrets.put("main", "a", {"X": "2"})
    assert env_digest(secrets.env_for("main", ["a"])) != before


def test_endpoints_name_their_secrets() -> None:
    assert EndpointSettings().secrets == []
    assert EndpointSettings(secrets=["openai", "db"]).secrets == ["openai", "db"]
    for bad, message in [
        ("openai", "must be a list"),
        ([1], "must be a list"),
        (["Open_AI"], "secret name 'Open_AI' is not allowed"),
        (["a", "a"], "names a secret twice"),
    ]:
        with pytest.raises(InvalidError, match=message):
            EndpointSettings(secrets=bad)  # type: ignore[arg-type]
