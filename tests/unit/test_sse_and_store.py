"""Server-sent events, the state store (on SQLite and on PostgreSQL), bearer tokens and the
log sink."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psycopg
import pytest
from store_backends import StoreOpener

from ember.wire.sse import Event, encode_event, parse_events
from ember_platform.edge.errors import http_error
from ember_platform.errors import Unauthorized
from ember_platform.observability import logs as logs_module
from ember_platform.observability.logs import LogFilter, LogSink, lines_backwards
from ember_platform.security.tokens import (
    TOKEN_PREFIX,
    Grant,
    LastAdminTokenError,
    NoSuchTokenError,
    Scope,
    TokenRegistry,
    hash_token,
    token_id,
)
from ember_platform.storage.records import (
    CallRecord,
    CallStatus,
    Deployment,
    SnapshotRecord,
    TokenRecord,
)
from ember_platform.storage.sqlite_store import SqliteStateStore
from ember_platform.storage.state_store import StoreWriteError
from ember_platform.storage.tables.store import TableStateStore

# --- SSE ---------------------------------------------------------------------------------


def _lines(stream: bytes) -> list[str]:
    """Split a byte stream into lines the way an HTTP client's iter_lines does."""
    return stream.decode().split("\n")


@pytest.mark.parametrize(
    "data",
    [
        '{"token": 1}',
        "",
        "plain text",
        " leading space",
        "two\nlines",
        "three\n\nlines with a blank one",
        "trailing newline\n",
        "\n",
        "data: looks like a field",
        ": looks like a comment",
        "unicode ✓ ü",
    ],
)
@pytest.mark.parametrize("event", [None, "error", "end"])
def test_encode_parse_round_trip(data: str, event: str | None) -> None:
    encoded = encode_event(data, event)
    assert encoded.endswith(b"\n\n")
    assert list(parse_events(_lines(encoded))) == [Event(event or "message", data)]


def test_encode_format() -> None:
    assert encode_event("a\nb") == b"data: a\ndata: b\n\n"
    assert encode_event("x", "error") == b"event: error\ndata: x\n\n"


def test_stream_of_several_events() -> None:
    stream = b"".join(
        [
            encode_event('{"i": 0}'),
            b": keep-alive comment\n\n",
            encode_event("multi\nline", "progress"),
            b":another comment\n",
            encode_event('{"i": 1}'),
            encode_event("boom", "error"),
        ]
    )
    events = list(parse_events(_lines(stream)))
    assert events == [
        Event("message", '{"i": 0}'),
        Event("progress", "multi\nline"),
        Event("message", '{"i": 1}'),
        Event("error", "boom"),
    ]


def test_parser_details() -> None:
    lines = [
        "event: custom",
        ": a comment inside an event",
        "id: 7",  # ignored field
        "retry: 100",  # ignored field
        "data:no space",
        "data:  two spaces",  # only one leading space is stripped
        "",
        "event: lonely",  # an event with no data dispatches nothing and resets
        "",
        "data",  # a field name alone: empty data line
        "",
        "data: last, without a blank line at the end",
    ]
    assert list(parse_events(lines)) == [
        Event("custom", "no space\n two spaces"),
        Event("message", ""),
        Event("message", "last, without a blank line at the end"),
    ]


def test_parser_is_lazy() -> None:
    def source() -> Iterator[str]:
        yield "data: first"
        yield ""
        raise AssertionError("read past the first event")

    assert next(parse_events(source())) == Event("message", "first")


# --- The state store, on both backends ---------------------------------------------------


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "ember.db"  # the folder does not exist yet


@pytest.fixture
def sqlite_store(db_path: Path) -> Iterator[SqliteStateStore]:
    s = SqliteStateStore(db_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def store(open_store: StoreOpener) -> TableStateStore:
    return open_store()  # closed by open_store


def deployment(app: str, version: int, digest: str = "sha256:0", at: float = 0.0) -> Deployment:
    manifest = {"app": app, "entry": "app.py", "endpoints": [{"name": "ep", "v": version}]}
    return Deployment(app, version, digest, manifest, at)


def test_empty_store(store: TableStateStore) -> None:
    assert store.latest_deployments() == []
    assert store.next_version("demo") == 1
    assert store.list_tokens() == []
    assert store.get_call("nope") is None
    assert store.unfinished_calls() == []
    assert store.delete_calls_finished_before(1e12) == 0
    assert store.delete_app("demo") is False


def test_every_version_of_an_app_is_listed_stopped_ones_too(store: TableStateStore) -> None:
    for version in (1, 2, 3):
        store.put_deployment(deployment("demo", version, f"sha256:{version}", float(version)))
    store.put_deployment(deployment("other", 1))
    store.delete_app("demo")
    assert [d.version for d in store.list_deployments("demo")] == [1, 2, 3]
    assert store.list_deployments("demo")[1].bundle_digest == "sha256:2"
    assert store.list_deployments("nope") == []


def test_latest_deployment_per_app(store: TableStateStore) -> None:
    store.put_deployment(deployment("zeta", 1, "sha256:z1", 1.0))
    assert store.next_version("zeta") == 2
    store.put_deployment(deployment("alpha", 1, "sha256:a1", 2.0))
    store.put_deployment(deployment("zeta", 2, "sha256:z2", 3.0))
    store.put_deployment(deployment("alpha", 2, "sha256:a2", 4.0))
    store.put_deployment(deployment("alpha", 3, "sha256:a3", 5.0))
    latest = store.latest_deployments()
    assert latest == [
        deployment("alpha", 3, "sha256:a3", 5.0),
        deployment("zeta", 2, "sha256:z2", 3.0),
    ]
    assert latest[0].manifest["endpoints"][0]["v"] == 3
    assert store.next_version("alpha") == 4
    assert store.next_version("zeta") == 3
    assert store.next_version("other") == 1


def test_put_deployment_replaces_same_version(store: TableStateStore) -> None:
    store.put_deployment(deployment("demo", 1, "sha256:old"))
    store.put_deployment(deployment("demo", 1, "sha256:new"))
    assert [d.bundle_digest for d in store.latest_deployments()] == ["sha256:new"]


def test_delete_app_hides_it_and_redeploy_after_stop(store: TableStateStore) -> None:
    store.put_deployment(deployment("demo", 1))
    store.put_deployment(deployment("demo", 2))
    store.put_deployment(deployment("keep", 1))
    assert store.delete_app("demo") is True
    assert [d.app for d in store.latest_deployments()] == ["keep"]
    assert store.delete_app("demo") is False  # already stopped
    # Versions keep counting across a stop, so a redeploy never reuses one.
    assert store.next_version("demo") == 3
    store.put_deployment(deployment("demo", 3, "sha256:again"))
    latest = {d.app: d for d in store.latest_deployments()}
    assert latest["demo"].version == 3
    assert latest["demo"].bundle_digest == "sha256:again"
    assert latest["keep"].version == 1


def test_tokens(store: TableStateStore) -> None:
    a = TokenRecord("h1", "admin", "bootstrap", 1.0)
    b = TokenRecord("h2", "invoke", "ci", 2.0)
    c = TokenRecord("h3", "invoke", "frontend", 3.0, app="shop")
    for token in (a, b, c):
        store.add_token(token)
    assert sorted(store.list_tokens(), key=lambda t: t.token_hash) == [a, b, c]
    with pytest.raises((sqlite3.IntegrityError, psycopg.IntegrityError)):
        store.add_token(TokenRecord("h1", "worker", "dup", 3.0))


def call(
    call_id: str,
    status: CallStatus = CallStatus.QUEUED,
    created_at: float = 0.0,
    finished_at: float | None = None,
    result: bytes | None = None,
) -> CallRecord:
    return CallRecord(
        id=call_id,
        label="app--ep",
        method="__call__",
        body=b'{"x": 1}\x00\xff',
        status=status,
        attempts=0,
        created_at=created_at,
        finished_at=finished_at,
        http_status=200 if result is not None else None,
        result=result,
    )


def test_calls_put_get_replace(store: TableStateStore) -> None:
    queued = call("c1", created_at=10.0)
    store.put_call(queued)
    assert store.get_call("c1") == queued
    done = call("c1", CallStatus.SUCCEEDED, 10.0, 12.5, b'{"ok": true}')
    done.attempts = 2
    store.put_call(done)
    got = store.get_call("c1")
    assert got == done
    assert got is not None
    assert isinstance(got.status, CallStatus)
    assert isinstance(got.body, bytes)
    assert got.status.finished


def test_a_file_result_keeps_its_media_type_and_name(store: TableStateStore) -> None:
    done = call("c1", CallStatus.SUCCEEDED, 10.0, 12.5, b"\x89PNG\r\n")
    done.media_type, done.filename = "image/png", "cat.png"
    store.put_call(done)
    assert store.get_call("c1") == done


def test_an_older_state_database_gains_the_new_columns(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with closing(sqlite3.connect(path)) as old:
        old.execute(
            "CREATE TABLE tokens (token_hash TEXT PRIMARY KEY, scope TEXT NOT NULL,"
            " name TEXT NOT NULL, created_at REAL NOT NULL)"
        )
        old.execute("INSERT INTO tokens VALUES ('h', 'invoke', 'ci', 1.0)")
        old.execute(
            "CREATE TABLE calls (id TEXT PRIMARY KEY, label TEXT NOT NULL, method TEXT NOT NULL,"
            " body BLOB NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL,"
            " created_at REAL NOT NULL, finished_at REAL, http_status INTEGER, result BLOB)"
        )
        old.execute(
            "INSERT INTO calls VALUES ('c0', 'app--ep', '__call__', x'7b7d', 'succeeded', 1,"
            " 1.0, 2.0, 200, x'5b315d')"
        )
        old.execute(
            "CREATE TABLE snapshots (key TEXT PRIMARY KEY, label TEXT NOT NULL,"
            " bundle_digest TEXT NOT NULL, env_key TEXT NOT NULL, size INTEGER NOT NULL,"
            " raw_size INTEGER NOT NULL, dump_seconds REAL NOT NULL, created_at REAL NOT NULL)"
        )
        old.execute("INSERT INTO snapshots VALUES ('k', 'a--b', 'sha256:aa', 'e', 1, 2, 0.5, 3.0)")
        old.commit()
    store = SqliteStateStore(path)
    assert store.list_tokens() == [TokenRecord("h", "invoke", "ci", 1.0)]  # for every app
    # An image from before image ids: its key alone names it on the nodes.
    assert store.list_snapshots() == [SnapshotRecord("k", "a--b", "sha256:aa", "e", 1, 2, 0.5, 3.0)]
    kept = store.get_call("c0")
    assert kept is not None and kept.result == b"[1]"
    assert (kept.media_type, kept.filename) == (None, None)  # JSON, as every result was
    store.put_call(call("c1", CallStatus.SUCCEEDED, 3.0, 4.0, b"{}"))
    store.close()
    assert SqliteStateStore(path).get_call("c1") is not None  # opening again changes nothing


def test_unfinished_calls_in_creation_order(store: TableStateStore) -> None:
    store.put_call(call("late", CallStatus.RUNNING, created_at=30.0))
    store.put_call(call("done", CallStatus.SUCCEEDED, 5.0, 6.0, b"{}"))
    store.put_call(call("early", CallStatus.QUEUED, created_at=10.0))
    store.put_call(call("failed", CallStatus.FAILED, 1.0, 2.0, b'{"error": {}}'))
    assert [c.id for c in store.unfinished_calls()] == ["early", "late"]


def test_delete_calls_finished_before(store: TableStateStore) -> None:
    store.put_call(call("old", CallStatus.SUCCEEDED, 0.0, 100.0, b"{}"))
    store.put_call(call("edge", CallStatus.FAILED, 0.0, 200.0, b"{}"))
    store.put_call(call("new", CallStatus.SUCCEEDED, 0.0, 300.0, b"{}"))
    store.put_call(call("pending", CallStatus.QUEUED, created_at=0.0))
    assert store.delete_calls_finished_before(200.0) == 1  # strictly before
    assert store.get_call("old") is None
    assert store.get_call("edge") is not None
    assert store.delete_calls_finished_before(1e12) == 2
    assert store.get_call("pending") is not None  # unfinished calls are never deleted


def test_a_full_database_fails_writes_with_store_write_error(
    sqlite_store: SqliteStateStore,
) -> None:
    store = sqlite_store
    store.put_call(call("kept", CallStatus.QUEUED, created_at=1.0))
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # as a full disk would
    big = call("big", CallStatus.SUCCEEDED, 1.0, 2.0, b"x" * 50_000)
    with pytest.raises(StoreWriteError, match="database or disk is full"):
        store.put_call(big)
    with pytest.raises(StoreWriteError):
        store.put_deployment(Deployment("demo", 1, "sha256:d", {"blob": "y" * 50_000}, 1.0))
    assert store.get_call("big") is None and store.latest_deployments() == []
    assert store.get_call("kept") is not None  # reads go on
    store._db.execute("PRAGMA max_page_count = 1073741823")
    store.put_call(big)
    assert store.get_call("big") == big


def test_data_survives_close_and_reopen(open_store: StoreOpener) -> None:
    first = open_store()
    try:
        first.put_deployment(deployment("demo", 1, "sha256:d1"))
        first.put_deployment(deployment("gone", 1))
        first.delete_app("gone")
        first.add_token(TokenRecord("h", "admin", "t", 1.0))
        first.put_call(call("c", CallStatus.RUNNING, created_at=1.0))
    finally:
        first.close()
    second = open_store()
    try:
        assert second.latest_deployments() == [deployment("demo", 1, "sha256:d1")]
        assert second.next_version("gone") == 2
        assert second.list_tokens() == [TokenRecord("h", "admin", "t", 1.0)]
        assert [c.id for c in second.unfinished_calls()] == ["c"]
    finally:
        second.close()


def test_wal_journal_mode(sqlite_store: SqliteStateStore, db_path: Path) -> None:
    store = sqlite_store
    store.put_deployment(deployment("demo", 1))
    with closing(sqlite3.connect(db_path)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        # Another connection sees what the store wrote (autocommit).
        assert db.execute("SELECT COUNT(*) FROM deployments").fetchone()[0] == 1


# --- TokenRegistry -----------------------------------------------------------------------


def test_create_stores_hash_not_token(sqlite_store: SqliteStateStore, db_path: Path) -> None:
    store = sqlite_store
    registry = TokenRegistry(store)
    token = registry.create(Scope.INVOKE, "ci")
    assert token.startswith(TOKEN_PREFIX)
    assert len(token) > len(TOKEN_PREFIX) + 30
    [record] = store.list_tokens()
    assert record.token_hash == hashlib.sha256(token.encode()).hexdigest() == hash_token(token)
    assert record.scope == "invoke"
    assert record.name == "ci"
    assert token not in json.dumps(record.__dict__)
    with closing(sqlite3.connect(db_path)) as db:
        dump = "\n".join(db.iterdump())
    assert token not in dump
    assert token[len(TOKEN_PREFIX) :] not in dump
    assert record.token_hash in dump


def test_tokens_are_unique(store: TableStateStore) -> None:
    registry = TokenRegistry(store)
    tokens = {registry.create(Scope.ADMIN, f"t{i}") for i in range(5)}
    assert len(tokens) == 5
    assert len(registry) == 5


@pytest.fixture
def registry(store: TableStateStore) -> TokenRegistry:
    return TokenRegistry(store)


def test_an_app_token_may_call_its_app_only(store: TableStateStore) -> None:
    registry = TokenRegistry(store)
    token = registry.create(Scope.INVOKE, "frontend", app="shop")
    grant = registry.grant_of(f"Bearer {token}")
    assert (
        grant == Grant(Scope.INVOKE, "shop", workspace="main")
        and registry.scope_of(f"Bearer {token}") is Scope.INVOKE
    )
    assert grant.may_call("shop") and not grant.may_call("other")
    assert Grant(Scope.INVOKE).may_call("other")  # a plain invoke token calls every app
    assert TokenRegistry(store).grant_of(f"Bearer {token}") == grant  # kept as made
    with pytest.raises(ValueError, match="only invoke tokens"):
        registry.create(Scope.ADMIN, "x", app="shop")


def test_a_workspace_token_reaches_its_workspace_only(store: TableStateStore) -> None:
    registry = TokenRegistry(store)
    deploy = registry.grant_of(f"Bearer {registry.create(Scope.DEPLOY, 'ci', workspace='team')}")
    assert deploy is not None and deploy.workspace == "team"
    assert deploy.scope.allows(Scope.INVOKE) and not deploy.scope.allows(Scope.ADMIN)
    assert not deploy.scope.allows(Scope.METRICS) and not deploy.scope.allows(Scope.WORKER)
    assert deploy.may_call("team--shop") and not deploy.may_call("shop")
    assert not deploy.may_call("other--shop")
    one_app = registry.create(Scope.INVOKE, "web", app="team--shop", workspace="team")
    grant = TokenRegistry(store).grant_of(f"Bearer {one_app}")  # kept as made
    assert grant == Grant(Scope.INVOKE, "team--shop", workspace="team")
    assert grant.may_call("team--shop") and not grant.may_call("team--cart")
    with pytest.raises(ValueError, match="not of workspace team"):
        registry.create(Scope.INVOKE, "x", app="shop", workspace="team")
    with pytest.raises(ValueError, match="of no one workspace"):
        registry.create(Scope.ADMIN, "x", workspace="team")
    # The platform's tokens reach every workspace.
    assert Grant(Scope.ADMIN).may_call("team--shop") and Grant(Scope.ADMIN).may_call("shop")


def test_scope_of_good_headers(registry: TokenRegistry) -> None:
    admin = registry.create(Scope.ADMIN, "a")
    invoke = registry.create(Scope.INVOKE, "i")
    worker = registry.create(Scope.WORKER, "w")
    assert registry.scope_of(f"Bearer {admin}") is Scope.ADMIN
    assert registry.scope_of(f"Bearer {invoke}") is Scope.INVOKE
    assert registry.scope_of(f"Bearer {worker}") is Scope.WORKER
    assert registry.scope_of(f"bearer {invoke}") is Scope.INVOKE
    assert registry.scope_of(f"BEARER {invoke}") is Scope.INVOKE
    assert registry.scope_of(f"Bearer {invoke}  ") is Scope.INVOKE


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer   ",
        "Bearer emb_not-a-real-token",
        "Basic {token}",
        "{token}",
        "Bearer{token}",
        "Token {token}",
        "Bearer {token} extra",
        "Bearer {token}x",
    ],
)
def test_scope_of_bad_missing_or_malformed(registry: TokenRegistry, header: str | None) -> None:
    token = registry.create(Scope.ADMIN, "a")
    value = header.replace("{token}", token) if header is not None else None
    assert registry.scope_of(value) is None


def test_registry_loads_tokens_from_store(open_store: StoreOpener) -> None:
    first = open_store()
    try:
        token = TokenRegistry(first).create(Scope.WORKER, "node")
    finally:
        first.close()
    second = open_store()
    try:
        assert TokenRegistry(second).scope_of(f"Bearer {token}") is Scope.WORKER
    finally:
        second.close()


def test_revoked_tokens_are_refused_at_once_and_after_a_restart(open_store: StoreOpener) -> None:
    store = open_store()
    try:
        registry = TokenRegistry(store)
        admin = registry.create(Scope.ADMIN, "admin")
        invoke = registry.create(Scope.INVOKE, "ci")
        heard: list[str] = []
        registry.on_revoke(heard.append)
        assert [t.name for t in registry.stored()] == ["admin", "ci"]
        record = registry.revoke(token_id(hash_token(invoke)))
        assert record.name == "ci" and heard == [hash_token(invoke)]
        assert registry.scope_of(f"Bearer {invoke}") is None
        assert registry.scope_of(f"Bearer {admin}") is Scope.ADMIN
        with pytest.raises(NoSuchTokenError):
            registry.revoke(token_id(hash_token(invoke)))  # not twice
        # The last admin token stays: without one nobody could manage the platform.
        with pytest.raises(LastAdminTokenError):
            registry.revoke(token_id(hash_token(admin)))
        second = registry.create(Scope.ADMIN, "second")
        registry.revoke(token_id(hash_token(admin)))
        assert registry.scope_of(f"Bearer {admin}") is None
    finally:
        store.close()
    again = open_store()
    try:
        registry = TokenRegistry(again)
        assert registry.scope_of(f"Bearer {invoke}") is None
        assert registry.scope_of(f"Bearer {admin}") is None
        assert registry.scope_of(f"Bearer {second}") is Scope.ADMIN
    finally:
        again.close()


def test_an_expired_token_is_refused_and_says_so_also_after_a_restart(
    open_store: StoreOpener,
) -> None:
    store = open_store()
    try:
        registry = TokenRegistry(store)
        admin = registry.create(Scope.ADMIN, "admin")
        soon = registry.create(Scope.INVOKE, "soon", expires_at=time.time() + 3600)
        gone = registry.create(Scope.INVOKE, "gone", expires_at=time.time() - 1)
        assert registry.scope_of(f"Bearer {soon}") is Scope.INVOKE
        assert registry.scope_of(f"Bearer {gone}") is None
        assert registry.refusal(f"Bearer {gone}").startswith("the token expired at ")
        assert registry.refusal("Bearer nonsense") == "missing or invalid token"
        with pytest.raises(Unauthorized, match="expired") as refused:
            registry.require(f"Bearer {gone}", Scope.INVOKE)
        assert http_error(refused.value).status == 401
        # An admin token that expires does not stand in for the lasting one.
        registry.create(Scope.ADMIN, "temporary", expires_at=time.time() + 60)
        with pytest.raises(LastAdminTokenError):
            registry.revoke(token_id(hash_token(admin)))
    finally:
        store.close()
    reopened = open_store()
    try:
        again = TokenRegistry(reopened)
        assert again.scope_of(f"Bearer {soon}") is Scope.INVOKE
        assert again.scope_of(f"Bearer {gone}") is None
        expiring = {t.name: t.expires_at for t in again.stored()}
        assert expiring["admin"] is None and expiring["soon"] is not None
    finally:
        reopened.close()


def refuse_writes(store: TableStateStore, refuse: bool) -> None:
    """Every write refused (or taken again), as a database that cannot write would."""
    if isinstance(store, SqliteStateStore):
        store._db.execute(f"PRAGMA query_only = {int(refuse)}")
    else:
        store._db.execute(f"SET default_transaction_read_only = {'on' if refuse else 'off'}")


def test_a_revoke_the_store_refuses_changes_nothing(
    store: TableStateStore, registry: TokenRegistry
) -> None:
    registry.create(Scope.ADMIN, "admin")
    invoke = registry.create(Scope.INVOKE, "ci")
    refuse_writes(store, True)
    with pytest.raises(StoreWriteError):
        registry.revoke(token_id(hash_token(invoke)))
    with pytest.raises(StoreWriteError):  # in a transaction too: none of it is kept
        store.queue_put("app", "q", [b"1", b"2"])
    refuse_writes(store, False)
    assert store.queue_length("app", "q") == 0
    assert registry.scope_of(f"Bearer {invoke}") is Scope.INVOKE


def test_ephemeral_tokens(store: TableStateStore, registry: TokenRegistry) -> None:
    registry.add_ephemeral("replica-secret", Scope.WORKER)
    assert registry.scope_of("Bearer replica-secret") is Scope.WORKER
    assert store.list_tokens() == []  # never written to the store
    assert TokenRegistry(store).scope_of("Bearer replica-secret") is None
    registry.remove_ephemeral("replica-secret")
    assert registry.scope_of("Bearer replica-secret") is None
    registry.remove_ephemeral("replica-secret")  # removing twice is harmless
    assert len(registry) == 0


@pytest.mark.parametrize(
    ("have", "needed", "allowed"),
    [
        (Scope.ADMIN, Scope.ADMIN, True),
        (Scope.ADMIN, Scope.INVOKE, True),
        (Scope.ADMIN, Scope.WORKER, True),
        (Scope.INVOKE, Scope.ADMIN, False),
        (Scope.INVOKE, Scope.INVOKE, True),
        (Scope.INVOKE, Scope.WORKER, False),
        (Scope.WORKER, Scope.ADMIN, False),
        (Scope.WORKER, Scope.INVOKE, False),
        (Scope.WORKER, Scope.WORKER, True),
    ],
)
def test_scope_allows_matrix(have: Scope, needed: Scope, allowed: bool) -> None:
    assert have.allows(needed) is allowed


# --- LogSink -----------------------------------------------------------------------------


def test_log_lines_that_cannot_be_written_still_reach_followers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = LogSink(tmp_path)
    follower = sink.follow("demo")
    (tmp_path / "demo.jsonl").mkdir()  # the file cannot be opened, as on a full disk
    sink.system("demo", "fn", "first")
    sink.system("demo", "fn", "second")
    assert [follower.get_nowait()["text"] for _ in range(2)] == ["first", "second"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "ember.logs"]
    assert len(warnings) == 1 and "not kept on disk" in warnings[0]  # said once
    (tmp_path / "demo.jsonl").rmdir()
    sink.system("demo", "fn", "third")
    assert [e["text"] for e in sink.tail("demo", 10)] == ["third"]
    assert follower.get_nowait()["text"] == "third"


def test_recent_calls_of_an_endpoint_an_app_or_all_newest_first(store: TableStateStore) -> None:
    for call_id, label, created_at in [
        ("a1", "app--ep", 1.0),
        ("a2", "app--ep2", 2.0),  # its label starts with the first one's
        ("a3", "app--ep", 3.0),
        ("b1", "app2--ep", 4.0),  # another app whose name starts with "app"
    ]:
        record = call(call_id, created_at=created_at)
        record.label = label
        store.put_call(record)
    assert [c.id for c in store.recent_calls(None, "app--ep", 10)] == ["a3", "a1"]
    assert [c.id for c in store.recent_calls("app", None, 10)] == ["a3", "a2", "a1"]
    assert [c.id for c in store.recent_calls(None, None, 2)] == ["b1", "a3"]


def test_log_filter_matches_endpoint_replica_and_age() -> None:
    entry = {"ts": 100.0, "endpoint": "fn", "replica": "r-1"}
    assert LogFilter().matches(entry) and LogFilter("fn", "r-1", 99.0).matches(entry)
    assert not LogFilter(replica="r-2").matches(entry)
    assert LogFilter(replica="r-").matches(entry)  # the first characters of an id do
    assert not LogFilter(since=101.0).matches(entry)
    assert not LogFilter(endpoint="other").matches(entry)
    assert not LogFilter(replica="r-1").matches({"ts": 100.0})  # platform lines name none
    said = {"ts": 100.0, "text": "Traceback: ValueError: bad shape"}
    assert LogFilter(grep="valueerror").matches(said)  # any case
    assert not LogFilter(grep="KeyError").matches(said)


def test_tail_counts_lines_after_the_filter_across_blocks_and_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs_module, "READ_BLOCK", 64)  # lines straddle many blocks
    sink = LogSink(tmp_path)
    old = [
        {"ts": float(i), "endpoint": "fn", "replica": "r-old", "text": f"old {i}"} for i in range(5)
    ]
    sink.write("demo", old)
    (tmp_path / "demo.jsonl").replace(tmp_path / "demo.jsonl.1")  # as rotation leaves it
    busy = [
        {"ts": 1000.0 + i, "endpoint": "fn", "replica": f"r-{i % 3}", "text": f"line {i}"}
        for i in range(300)
    ]
    sink.write("demo", busy)
    assert [e["text"] for e in sink.tail("demo", 3)] == ["line 297", "line 298", "line 299"]
    mine = sink.tail("demo", 50, LogFilter(replica="r-1"))
    assert len(mine) == 50 and all(e["replica"] == "r-1" for e in mine)
    assert mine[-1]["text"] == "line 298" and mine[0]["text"] == "line 151"
    # Reaches into the rotated file when the current one has too few matches.
    assert [e["text"] for e in sink.tail("demo", 2, LogFilter(replica="r-old"))] == [
        "old 3",
        "old 4",
    ]
    assert len(sink.tail("demo", 1000)) == 305
    recent = sink.tail("demo", 1000, LogFilter(since=1290.0))
    assert [e["text"] for e in recent] == [f"line {i}" for i in range(290, 300)]
    assert sink.tail("demo", 0) == [] and sink.tail("nobody", 10) == []


def test_lines_backwards_reads_a_file_last_line_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs_module, "READ_BLOCK", 7)
    path = tmp_path / "f"
    path.write_bytes(b"alpha\nbeta\n\ngamma-is-long\nd")
    assert list(lines_backwards(path)) == [b"d", b"gamma-is-long", b"", b"beta", b"alpha"]
    path.write_bytes(b"")
    assert list(lines_backwards(path)) == [b""]
