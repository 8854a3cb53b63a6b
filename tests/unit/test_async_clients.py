"""asyncio clients kept per event loop: one per loop and key, closed with its loop."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ember.calling import connections, eventloop
from ember.calling.connections import kept_client

made: list[httpx.AsyncClient] = []


def make() -> httpx.AsyncClient:
    client = httpx.AsyncClient()
    made.append(client)
    return client


@pytest.fixture(autouse=True)
def _fresh() -> None:
    made.clear()


@pytest.mark.parametrize("run", [asyncio.run, eventloop.run], ids=["asyncio", "uvloop"])
def test_one_client_per_loop_and_key_closed_when_the_loop_ends(run) -> None:  # type: ignore[no-untyped-def]
    async def use() -> tuple[httpx.AsyncClient, ...]:
        first = await kept_client("a", make)
        again = await kept_client("a", make)
        other = await kept_client("b", make)
        assert not first.is_closed
        return first, again, other

    first, again, other = run(use())
    assert first is again and first is not other
    assert first.is_closed and other.is_closed  # closed with the loop
    (later, _, _) = run(use())
    assert later is not first  # a new loop, a new client
    assert len(made) == 4


def test_a_loop_closed_without_closing_its_generators_is_forgotten() -> None:
    loop = asyncio.new_event_loop()
    first = loop.run_until_complete(kept_client("a", make))
    loop.close()  # no shutdown_asyncgens: the client cannot be closed on it any more

    async def again() -> httpx.AsyncClient:
        client = await kept_client("a", make)
        # The closed loop's client is dropped, not kept beside the new loop's.
        assert not [kept for kept in connections._kept.values() if kept.loop.is_closed()]
        return client

    assert asyncio.run(again()) is not first
