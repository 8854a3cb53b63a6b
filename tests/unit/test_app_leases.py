"""The apps' leases on a real PostgreSQL: the deployed apps spread evenly over the live
processes; a dead process's apps are taken over once its time is up, a joining one gets
its share, an orderly stop gives every app up at once, a stopped app's lease is dropped,
and a process cut off from the database owns nothing before another takes its apps."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import psycopg
import pytest

from ember_platform.peers.app_leases import AppLeases, AppRound
from ember_platform.peers.app_ownership import AppOwnership
from ember_platform.storage.postgres_store import PostgresStateStore
from ember_platform.storage.records import Deployment

APPS = sorted(f"default/app{i}" for i in range(12))


@pytest.fixture
def database(postgres_url: str) -> str:
    store = PostgresStateStore(postgres_url)  # the schema, with its leases table
    try:
        for app in APPS:
            store.put_deployment(Deployment(app, 1, "sha256:" + "0" * 64, {}, time.time()))
    finally:
        store.close()
    return postgres_url


def leases(url: str, holder: str, ttl: float = 30.0) -> AppLeases:
    return AppLeases(url, holder, f"https://{holder}:8443", ttl=ttl, margin=ttl / 4)


def rounds(*processes: AppLeases, times: int = 4) -> dict[str, AppRound]:
    """Rounds of each in turn, as their keepers run them (what a round says to give up
    given up after it, as once the loop stopped acting for it)."""
    last: dict[str, AppRound] = {}
    for _ in range(times):
        for process in processes:
            found = process.round()
            if found.to_give:
                process.give_up(found.to_give)
            last[process.holder] = found
    return last


def owners(database: str) -> dict[str, str]:
    return {app: holder for app, (holder, _term) in held(database).items()}


def held(database: str) -> dict[str, tuple[str, int]]:
    """app -> (holder, term) of the live app leases."""
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, holder, term FROM leases WHERE name LIKE 'app:%' "
            "AND expires_at > EXTRACT(EPOCH FROM clock_timestamp())"
        ).fetchall()
    return {str(name).removeprefix("app:"): (str(holder), int(term)) for name, holder, term in rows}


def test_apps_spread_evenly_and_every_process_knows_every_owner(database: str) -> None:
    a, b, c = (leases(database, name) for name in "abc")
    found = rounds(a, b, c)
    assert sorted(owners(database)) == APPS
    assert Counter(owners(database).values()) == {"a": 4, "b": 4, "c": 4}
    for name, seen in found.items():
        assert len(seen.owned) == 4 and seen.members == 3
        assert all(owners(database)[app] == name for app in seen.owned)
    # Every process can tell a caller where any app's owner serves.
    theirs = found["a"].owners
    assert {app: url for app, url in theirs.items()} == {
        app: f"https://{holder}:8443" for app, holder in owners(database).items()
    }
    for process in (a, b, c):
        process.close()


def test_a_dead_process_apps_move_once_its_time_is_up(database: str) -> None:
    a, b, c = (leases(database, name, ttl=1.5) for name in "abc")
    rounds(a, b, c)
    terms = held(database)
    before = owners(database)
    for _ in range(4):
        rounds(a, c, times=1)  # b is silent from now on
        time.sleep(0.5)
    found = rounds(a, c, times=2)
    after = owners(database)
    assert sorted(after) == APPS and set(after.values()) == {"a", "c"}
    assert Counter(after.values()) == {"a": 6, "c": 6}
    assert all(after[app] == holder for app, holder in before.items() if holder != "b")
    # The terms of b's apps went up: a write of b's made under its old term is fenced.
    for app, (holder, term) in terms.items():
        assert found[after[app]].owned[app] == (term + 1 if holder == "b" else term)
    for process in (a, b, c):
        process.close()


def test_a_joiner_gets_its_share_without_taking_a_held_app(database: str) -> None:
    a, b = leases(database, "a"), leases(database, "b")
    rounds(a, b)
    assert Counter(owners(database).values()) == {"a": 6, "b": 6}
    c = leases(database, "c")
    first = c.round()
    assert first.owned == {}  # nothing free yet: it waits for what the others give up
    rounds(a, b, c)
    assert Counter(owners(database).values()) == {"a": 4, "b": 4, "c": 4}
    for process in (a, b, c):
        process.close()


def test_an_orderly_stop_gives_every_app_up_at_once(database: str) -> None:
    a, b = leases(database, "a"), leases(database, "b")
    rounds(a, b)
    b.leave()
    found = a.round()
    assert len(found.owned) == 12 and found.members == 1
    assert set(owners(database).values()) == {"a"}
    a.close()
    b.close()


def test_a_stopped_app_is_dropped_and_a_new_one_taken(database: str) -> None:
    a, b = leases(database, "a"), leases(database, "b")
    rounds(a, b)
    store = PostgresStateStore(database)
    try:
        assert store.delete_app(APPS[0])
        store.put_deployment(Deployment("other/new", 1, "sha256:" + "1" * 64, {}, time.time()))
    finally:
        store.close()
    rounds(a, b)
    now = owners(database)
    assert APPS[0] not in now and "other/new" in now and len(now) == 12
    a.close()
    b.close()


def test_a_process_cut_off_from_the_database_owns_nothing_before_another_takes_over(
    database: str,
) -> None:
    async def run() -> None:
        ttl = 0.8
        a = AppOwnership(leases(database, "a", ttl), interval=ttl / 8)
        b = AppOwnership(leases(database, "b", ttl), interval=ttl / 8)
        a.start()
        b.start()
        while len(a.owned) != 6 or len(b.owned) != 6:
            await asyncio.sleep(0.02)
        a.leases.db.url = "postgresql://ember@127.0.0.1:9/none?connect_timeout=1"
        conn = a.leases.db._conn
        assert conn is not None
        with psycopg.connect(database, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        theirs = set(a.owned)
        # Whenever b owns any of a's apps, a owns none any more: checked on the loop
        # both keepers report to, at every turn until b has them all.
        while not theirs <= b.owned.keys():
            if theirs & b.owned.keys():
                assert not a.owned, "b took apps a still acted for"
            await asyncio.sleep(0)
        assert not a.owned
        assert a.problem is not None and "cannot reach" in a.problem
        await a.stop(leave=False)
        await b.stop(leave=True)

    asyncio.run(run())


def test_a_process_giving_apps_up_to_a_joiner_stops_acting_for_them_first(
    database: str,
) -> None:
    """A joins alone and owns every app; B joins and gets its share as A gives them up.
    At no turn of the loop both keepers report to does an app count as owned by both."""

    async def run() -> None:
        ttl = 2.0
        a = AppOwnership(leases(database, "a", ttl), interval=ttl / 8)
        a.start()
        while len(a.owned) != 12:
            await asyncio.sleep(0.01)
        b = AppOwnership(leases(database, "b", ttl), interval=ttl / 8)
        b.start()
        while len(b.owned) != 6 or len(a.owned) != 6:
            both = a.owned.keys() & b.owned.keys()
            assert not both, f"{sorted(both)} owned by both at once"
            await asyncio.sleep(0)
        await a.stop(leave=True)
        await b.stop(leave=True)

    asyncio.run(run())
