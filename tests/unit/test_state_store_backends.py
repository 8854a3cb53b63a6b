"""What both state store backends must agree on beyond the store suite's basics: their
migrations, the workspace purge and call listings by label prefix, code-point order of
paths, every table's round trip; and PostgreSQL's own cases: a lost connection, a
database out of reach."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psycopg
import pytest
from machine_needs import need
from postgres_cluster import ClusterError, PostgresCluster, start_cluster
from store_backends import StoreOpener

from ember.errors import ConfigError
from ember_platform.config import ServerConfig
from ember_platform.storage.migrations import BASELINE, MIGRATIONS
from ember_platform.storage.postgres.dialect import postgres_ddl, shown
from ember_platform.storage.postgres_store import PostgresStateStore
from ember_platform.storage.records import (
    WEBHOOK_PENDING,
    BatchRecord,
    CallRecord,
    CallStatus,
    Deployment,
    OpenAIFileRecord,
    ReplicaUsage,
    ScalingOverride,
    SecretRecord,
    SnapshotRecord,
    TokenRecord,
    TokenUsage,
    VolumeFile,
    WorkspaceRecord,
)
from ember_platform.storage.sqlite_store import SqliteStateStore
from ember_platform.storage.state_store import StoreUnavailableError
from ember_platform.store_opening import open_state_store


def applied(store: object) -> list[tuple[int, str]]:
    rows = store._db.execute("SELECT version, name FROM schema_migrations ORDER BY version")  # type: ignore[attr-defined]
    return [(int(v), n) for v, n in rows]


def test_migrations_are_taken_once(open_store: StoreOpener) -> None:
    first = open_store()
    first.put_secret(SecretRecord("s", {"K": "v"}, 1.0))
    assert applied(first) == [(m.version, m.name) for m in MIGRATIONS]
    first.close()
    again = open_store()
    assert applied(again) == [(m.version, m.name) for m in MIGRATIONS]
    assert again.list_secrets() == [SecretRecord("s", {"K": "v"}, 1.0)]


def test_a_sqlite_state_dir_from_before_migrations_is_taken_in_place(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with closing(sqlite3.connect(path)) as old:  # today's tables, as the server made them
        for statement in BASELINE:
            old.execute(statement)
        old.execute("INSERT INTO workspaces VALUES ('team', 1.0)")
        old.commit()
    store = SqliteStateStore(path)
    assert applied(store) == [(m.version, m.name) for m in MIGRATIONS]  # the rest taken too
    assert store.list_workspaces() == [WorkspaceRecord("team", 1.0)]
    store.close()


def test_an_older_postgres_table_gains_the_new_columns(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as old:
        old.execute(
            postgres_ddl(
                "CREATE TABLE tokens (token_hash TEXT PRIMARY KEY, scope TEXT NOT NULL,"
                " name TEXT NOT NULL, created_at REAL NOT NULL)"
            )
        )
        old.execute("INSERT INTO tokens VALUES ('h', 'invoke', 'ci', 1.0)")
    store = PostgresStateStore(postgres_url)
    assert store.list_tokens() == [TokenRecord("h", "invoke", "ci", 1.0)]
    store.add_token(TokenRecord("w", "deploy", "team", 2.0, workspace="team"))
    assert {t.workspace for t in store.list_tokens()} == {None, "team"}
    store.close()


def call(call_id: str, label: str, created_at: float) -> CallRecord:
    return CallRecord(call_id, label, "__call__", b"{}", CallStatus.QUEUED, 0, created_at)


def test_a_workspace_is_purged_by_its_prefix_alone(open_store: StoreOpener) -> None:
    store = open_store()
    store.put_workspace(WorkspaceRecord("team", 1.0))
    store.put_workspace(WorkspaceRecord("team-b", 1.0))
    for key in ("team--shop", "team-b--shop", "shop"):
        store.put_deployment(Deployment(key, 1, "sha256:0", {"app": key}, 1.0))
        store.dict_put(key, "d", "k", b"1", None)
        store.queue_put(key, "q", [b"1"])
        store.volume_put_file(key, "v", VolumeFile("a", "sha256:a", 1, 1.0))
    for secret in ("team--s", "team-b--s", "s"):  # a workspace's are stored as "ws--name"
        store.put_secret(SecretRecord(secret, {}, 1.0))
    for i, label in enumerate(("team--shop--ep", "team-b--shop--ep", "shop--ep")):
        store.put_call(call(f"c{i}", label, float(i)))
    store.add_token(TokenRecord("t1", "deploy", "ci", 1.0, workspace="team"))
    store.add_token(TokenRecord("t2", "deploy", "ci", 1.0, workspace="team-b"))
    assert [c.id for c in store.recent_calls(None, None, 10, "team")] == ["c0"]
    assert [c.id for c in store.recent_calls(None, None, 10)] == ["c2"]  # main's apps
    assert [c.id for c in store.recent_calls("team--shop", None, 10)] == ["c0"]
    # None: every workspace's, for the operator's `ember calls ls --all-workspaces`.
    assert [c.id for c in store.recent_calls(None, None, 10, None)] == ["c2", "c1", "c0"]
    assert store.delete_workspace("team") is True
    assert store.delete_workspace("team") is False
    assert [w.name for w in store.list_workspaces()] == ["team-b"]
    assert [d.app for d in store.latest_deployments()] == ["shop", "team-b--shop"]
    assert store.dict_count("team--shop", "d", 0.0) == 0
    assert store.dict_count("team-b--shop", "d", 0.0) == 1
    assert store.queue_length("team--shop", "q") == 0 and store.queue_length("shop", "q") == 1
    assert store.volumes("team--shop") == [] and store.volumes("team-b--shop") == [("v", 1, 1)]
    assert sorted(s.name for s in store.list_secrets()) == ["s", "team-b--s"]
    assert [t.token_hash for t in store.list_tokens()] == ["t2"]
    assert store.get_call("c0") is None and store.get_call("c1") is not None


def test_paths_and_keys_page_in_code_point_order(open_store: StoreOpener) -> None:
    store = open_store()
    names = ["b", "B", "a/x", "a.txt", "é", "Z", "a b", "ab"]
    for name in names:
        store.volume_put_file("app", "v", VolumeFile(name, "sha256:x", 3, 1.0))
        store.dict_put("app", "d", name, b"1", None)
    assert [f.path for f in store.volume_files("app", "v")] == sorted(names)
    assert store.dict_keys("app", "d", 0.0, 100) == sorted(names)
    assert store.dict_keys("app", "d", 0.0, 2, after="a") == sorted(names)[2:4]
    assert [f.path for f in store.volume_files("app", "v", prefix="a")] == ["a/x"]
    assert store.volumes("app") == [("v", len(names), 3 * len(names))]
    assert store.volume_digest_used("sha256:x") and not store.volume_digest_used("sha256:y")


def terminate_connections(url: str) -> None:
    """As a database restart would: every other connection to the database is cut."""
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def test_postgres_connects_again_after_losing_its_connection(postgres_url: str) -> None:
    store = PostgresStateStore(postgres_url)
    store.put_secret(SecretRecord("before", {}, 1.0))
    terminate_connections(postgres_url)
    # A write found lost as it is tried is not tried again (it may have landed).
    with pytest.raises(StoreUnavailableError, match="was lost"):
        store.put_secret(SecretRecord("lost", {}, 2.0))
    store.put_secret(SecretRecord("after", {}, 3.0))
    terminate_connections(postgres_url)
    # A read is, on a new connection.
    assert sorted(s.name for s in store.list_secrets()) == ["after", "before"]
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):  # not opened again
        store.list_secrets()


@pytest.fixture
def own_cluster() -> Iterator[PostgresCluster]:
    """A cluster of this test's own, to stop and start."""
    try:
        cluster = start_cluster()
    except ClusterError as error:
        need("postgres", str(error))
    yield cluster
    cluster.stop()


def test_postgres_out_of_reach_while_serving_then_back(own_cluster: PostgresCluster) -> None:
    store = PostgresStateStore(own_cluster.new_database())
    store.put_secret(SecretRecord("before", {}, 1.0))
    own_cluster.stop_server()
    for attempt in range(3):  # at once each time, connection refused or not tried again
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="state database postgresql://"):
            store.list_secrets()
        with pytest.raises(StoreUnavailableError):  # a StoreWriteError: a 503, not a 507
            store.queue_put("app", "q", [b"1"])
        assert time.monotonic() - started < 1.9, attempt  # never the 2 s reconnect wait
    own_cluster.start_server()
    deadline = time.monotonic() + 10
    while True:
        try:
            names = [s.name for s in store.list_secrets()]
            break
        except StoreUnavailableError:
            assert time.monotonic() < deadline, "the store did not come back"
            time.sleep(0.1)
    assert names == ["before"]
    store.queue_put("app", "q", [b"1"])
    assert store.queue_take("app", "q", 5) == [b"1"]
    store.close()


def test_a_postgres_database_out_of_reach_is_named(postgres_url: str) -> None:
    url = postgres_url.replace("ember@", "ember:hunter2@").rsplit("/", 1)[0] + "/nowhere"
    with pytest.raises(ConfigError, match="cannot reach the state database") as refused:
        PostgresStateStore(url)
    assert "ember:***@127.0.0.1" in str(refused.value) and "hunter2" not in str(refused.value)
    assert 'database "nowhere" does not exist' in str(refused.value)


def test_canaries_overrides_and_drained_nodes(open_store: StoreOpener) -> None:
    store = open_store()
    store.put_deployment(Deployment("shop", 1, "sha256:1", {"v": 1}, 1.0))
    store.put_deployment(Deployment("shop", 2, "sha256:2", {"v": 2}, 2.0, canary_percent=10))
    assert [d.version for d in store.latest_deployments()] == [1]  # a canary does not serve
    assert [(d.version, d.canary_percent) for d in store.canary_deployments()] == [(2, 10)]
    store.set_canary_percent("shop", 2, None)  # promoted
    assert [d.version for d in store.latest_deployments()] == [2]
    store.put_deployment(Deployment("shop", 3, "sha256:3", {"v": 3}, 3.0, canary_percent=50))
    store.withdraw_deployment("shop", 3)
    assert store.canary_deployments() == [] and store.list_deployments("shop")[2].withdrawn
    override = ScalingOverride("shop--ep", "shop", 2, {"min_replicas": 2}, 4.0)
    store.put_scaling_override(override)
    store.put_scaling_override(ScalingOverride("shop--ep", "shop", 2, {"max_replicas": 9}, 5.0))
    assert [o.settings for o in store.list_scaling_overrides()] == [{"max_replicas": 9}]
    store.delete_scaling_override("shop--ep")
    assert store.list_scaling_overrides() == []
    store.put_draining_node("node-b", 1.0)
    store.put_draining_node("node-a", 2.0)
    store.put_draining_node("node-a", 3.0)  # already drained: kept as it was
    assert store.list_draining_nodes() == ["node-a", "node-b"]
    store.delete_draining_node("node-a")
    assert store.list_draining_nodes() == ["node-b"]


def test_webhooks_usage_snapshots_and_blob_deletes(open_store: StoreOpener) -> None:
    store = open_store()
    for call_id, finished in (("late", 9.0), ("early", 5.0)):
        ended = CallRecord(call_id, "a--b", "m", b"{}", CallStatus.SUCCEEDED, 1, 0.0, finished)
        ended.webhook, ended.webhook_state = "https://hook.example/x", WEBHOOK_PENDING
        store.put_call(ended)
    assert [c.id for c in store.pending_webhooks()] == ["early", "late"]
    usage = ReplicaUsage("r1", "a", "b", "H100", 1, 2.5, 4096, "restore", 7, 10.0, 20.0)
    store.put_usage(usage)
    store.put_usage(ReplicaUsage("r0", "a", "b", None, 0, 1.0, 512, None, 0, 1.0, 5.0))
    assert store.usage_since(10.0) == [usage]
    assert store.delete_usage_before(10.0) == 1 and store.usage_since(0.0) == [usage]
    big = 5 * 2**30  # sizes past 32 bits
    image = SnapshotRecord("k", "a--b", "sha256:a", "env", big, 2 * big, 1.5, 2.0, "img", 3)
    store.put_snapshot(SnapshotRecord("k0", "a--b", "sha256:a", "env", 1, 2, 0.5, 1.0))
    store.put_snapshot(image)
    assert store.list_snapshots()[1] == image
    store.put_snapshot(SnapshotRecord("k", "a--b", "sha256:a", "env", 1, 2, 0.5, 3.0, "img2"))
    assert [s.image_id for s in store.list_snapshots()] == ["", "img2"]
    store.delete_snapshot("k0")
    assert [s.key for s in store.list_snapshots()] == ["k"]
    store.add_blob_delete("bundles/x", 1.0)
    store.add_blob_delete("bundles/x", 2.0)  # once
    assert store.blob_deletes() == ["bundles/x"]
    store.remove_blob_delete("bundles/x")
    assert store.blob_deletes() == []


@pytest.mark.parametrize(
    ("url", "seen"),
    [
        ("postgresql://ember:pw@db:5432/ember", "postgresql://ember:***@db:5432/ember"),
        ("postgresql://db/ember?password=pw&sslmode=require", "postgresql://db/ember?password=***&sslmode=require"),
        ("postgres://ember@db/ember", "postgres://ember@db/ember"),
    ],
)  # fmt: skip
def test_a_database_url_is_shown_without_its_password(url: str, seen: str) -> None:
    assert shown(url) == seen


def test_a_state_dir_database_left_behind_by_database_is_warned_of(
    tmp_path: Path, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(state_dir=tmp_path, database=postgres_url)
    open_state_store(config).close()
    assert not caplog.records and not config.db_path.exists()
    SqliteStateStore(config.db_path).close()  # as a server without --database left it
    store = open_state_store(config)
    assert isinstance(store, PostgresStateStore)
    store.close()
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"{config.db_path} holds the state kept before --database" in warning


def test_dashboard_sessions_end_with_their_token_workspace_or_deadline(
    open_store: StoreOpener,
) -> None:
    store = open_store()
    store.put_workspace(WorkspaceRecord("team", 1.0))
    store.add_token(TokenRecord("t-main", "admin", "op", 1.0))
    store.add_token(TokenRecord("t-team", "deploy", "ci", 1.0, workspace="team"))
    store.add_token(TokenRecord("t-gone", "deploy", "ci", 1.0))
    store.put_dashboard_session("s1", "t-main", 100.0, 1.0)
    store.put_dashboard_session("s2", "t-team", 100.0, 1.0)
    store.put_dashboard_session("s3", "t-gone", 100.0, 1.0)
    store.put_dashboard_session("s4", "t-main", 50.0, 1.0)
    assert store.dashboard_session("s1") == ("t-main", 100.0)
    assert store.dashboard_session("nope") is None
    assert store.delete_token("t-gone") is True and store.delete_token("t-gone") is False
    assert store.dashboard_session("s3") is None  # went with its token
    assert store.delete_workspace("team") is True
    assert store.dashboard_session("s2") is None  # went with its workspace's token
    store.delete_dashboard_sessions([], ended_by=50.0)  # the ended ones only
    assert store.dashboard_session("s4") is None and store.dashboard_session("s1") is not None
    store.delete_dashboard_sessions(["s1"], ended_by=0.0)
    assert store.dashboard_session("s1") is None


def test_batch_api_files_batches_and_token_counts(open_store: StoreOpener) -> None:
    store = open_store()
    label = "team--shop--chat"
    for n, made in enumerate((10.0, 20.0)):
        store.put_openai_file(OpenAIFileRecord(f"file-{n}", label, "batch", "in.jsonl", 5, made))
    store.put_openai_file(OpenAIFileRecord("file-main", "shop--chat", "batch", "x", 1, 30.0))
    assert [f.id for f in store.list_openai_files(label, 10)] == ["file-1", "file-0"]
    assert sorted(store.openai_files_of_workspace("team")) == ["file-0", "file-1"]
    batch = BatchRecord("batch_1", label, "in_progress", '{"id": "batch_1"}', 0, 11.0)
    store.put_batch(batch)
    store.put_batch(BatchRecord("batch_2", label, "completed", "{}", 3, 12.0))
    assert [b.id for b in store.unfinished_batches()] == ["batch_1"]
    batch.status, batch.next_line = "finalizing", 7
    store.put_batch(batch)
    assert store.get_batch("batch_1") == batch
    # Token counts of one minute add up; a period's are summed by endpoint and traffic.
    for minute, wrote in ((60.0, 3), (60.0, 4), (120.0, 5)):
        store.add_token_usage(TokenUsage("team--shop", "chat", "batch", minute, 10, wrote, 1))
    (summed,) = store.token_usage_since(60.0)
    assert (summed.input_tokens, summed.output_tokens, summed.requests) == (30, 12, 3)
    assert store.delete_openai_file("file-0") and store.get_openai_file("file-0") is None
    reopened = open_store()  # kept across a restart
    assert reopened.get_batch("batch_2") is not None
