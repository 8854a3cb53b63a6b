"""The platform's lease on a real PostgreSQL: one holder at a time, taken over only once
its time is up on the database's clock, given up at an orderly stop, and a holder cut off
from the database stops acting (fencing) before another may take over."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest

from ember_platform.peers.leadership import Leadership
from ember_platform.peers.lease_connection import LeaseUnavailable
from ember_platform.peers.platform_lease import PlatformLease
from ember_platform.storage.postgres_store import PostgresStateStore


@pytest.fixture
def database(postgres_url: str) -> str:
    PostgresStateStore(postgres_url).close()  # the schema, with migration 4's leases table
    return postgres_url


def lease(url: str, holder: str, ttl: float = 0.6) -> PlatformLease:
    return PlatformLease(url, holder, f"https://{holder}:8443", ttl=ttl, margin=ttl / 4)


def test_one_holder_at_a_time_and_a_takeover_once_its_time_is_up(database: str) -> None:
    a, b = lease(database, "a"), lease(database, "b")
    first = a.take()
    assert first.held and first.term == 1
    assert first.valid_until <= time.monotonic() + 0.6 - 0.15
    seen = b.take()
    assert not seen.held and seen.holder == "a" and seen.holder_url == "https://a:8443"
    assert not seen.expired
    assert a.take().held  # a renewal
    time.sleep(0.7)
    taken = b.take()
    assert taken.held and taken.term == 2  # a new hand, a new term
    lost = a.take()
    assert not lost.held and lost.holder == "b"
    a.close()
    b.close()


def test_an_orderly_stop_gives_the_lease_up_at_once(database: str) -> None:
    a, b = lease(database, "a", ttl=30), lease(database, "b", ttl=30)
    assert a.take().held
    assert not b.take().held
    b.release()  # not b's: changes nothing
    assert not b.take().held
    a.release()
    assert b.take().held
    a.close()
    b.close()


def test_an_unreachable_database_is_said() -> None:
    nowhere = lease("postgresql://ember@127.0.0.1:9/none?connect_timeout=1", "a")
    with pytest.raises(LeaseUnavailable, match="cannot reach"):
        nowhere.take()


def test_a_holder_cut_off_from_the_database_stops_before_another_takes_over(
    database: str,
) -> None:
    async def run() -> tuple[float, float]:
        ttl = 0.8
        a = Leadership(lease(database, "a", ttl), interval=ttl / 8)
        b = Leadership(lease(database, "b", ttl), interval=ttl / 8)
        a.start()
        await asyncio.wait_for(a.held.wait(), 5)
        b.start()
        await asyncio.wait_for(b.owner_known.wait(), 5)
        assert b.owner_url == "https://a:8443" and not b.held.is_set()
        # a's database connection is cut: its renewals fail from now on.
        a.lease.db.url = "postgresql://ember@127.0.0.1:9/none?connect_timeout=1"
        conn = a.lease.db._conn
        assert conn is not None
        with psycopg.connect(database, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'ember-lease' AND pid = %s",
                (conn.info.backend_pid,),
            )
        await asyncio.wait_for(a.lost.wait(), 5)
        fenced_at = time.monotonic()
        assert not a.held.is_set()
        await asyncio.wait_for(b.held.wait(), 5)
        taken_at = time.monotonic()
        assert b.owner_url == "https://b:8443"
        await a.stop(release=False)
        await b.stop(release=True)
        return fenced_at, taken_at

    fenced_at, taken_at = asyncio.run(run())
    assert fenced_at < taken_at
