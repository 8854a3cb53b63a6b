"""The apps' spread over the live control-plane processes (a pure policy): even shares,
each process moving only its own leases, never taking an app a live process holds."""

from __future__ import annotations

from ember_platform.peers.app_spread import AppsView, Moves, moves, shares

APPS = [f"ws/app{i}" for i in range(12)]


def settle(members: list[str], holders: dict[str, str], apps: list[str]) -> dict[str, str]:
    """Rounds of every member in turn, as their keepers run them, until nothing moves;
    a take of an app already held (a race the database settles) is refused."""
    for _ in range(20):
        moved = False
        for member in members:
            plan = moves(AppsView(members, apps, dict(holders)), member)
            for app in plan.give | plan.drop:
                del holders[app]
                moved = True
            for app in plan.take:
                if app not in holders:
                    holders[app] = member
                    moved = True
        if not moved:
            return holders
    raise AssertionError("the spread did not settle")


def counts(holders: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for holder in holders.values():
        out[holder] = out.get(holder, 0) + 1
    return out


def test_shares_are_even_and_the_remainder_goes_to_the_first_ids() -> None:
    assert shares(12, ["c", "a", "b"]) == {"a": 4, "b": 4, "c": 4}
    assert shares(13, ["c", "a", "b"]) == {"a": 5, "b": 4, "c": 4}
    assert shares(1, ["b", "a"]) == {"a": 1, "b": 0}
    assert shares(3, []) == {}


def test_a_lone_process_takes_every_app() -> None:
    plan = moves(AppsView(["a"], APPS, {}), "a")
    assert plan == Moves(frozenset(APPS), frozenset(), frozenset())


def test_three_processes_settle_on_four_apps_each() -> None:
    holders = settle(["a", "b", "c"], {}, APPS)
    assert sorted(holders) == sorted(APPS)
    assert counts(holders) == {"a": 4, "b": 4, "c": 4}


def test_a_joiner_gets_its_share_as_the_others_give_theirs_up() -> None:
    holders = settle(["a", "b"], {}, APPS)
    before = dict(holders)
    # The joiner takes nothing held: it waits for what the others give.
    plan = moves(AppsView(["a", "b", "c"], APPS, holders), "c")
    assert plan.take == frozenset()
    holders = settle(["a", "b", "c"], holders, APPS)
    assert counts(holders) == {"a": 4, "b": 4, "c": 4}
    # Only what had to move moved: a and b each kept 4 of their 6.
    kept = sum(1 for app, holder in holders.items() if before[app] == holder)
    assert kept == 8


def test_a_dead_process_apps_go_to_the_live_ones() -> None:
    holders = settle(["a", "b", "c"], {}, APPS)
    alive = {app: holder for app, holder in holders.items() if holder != "b"}  # b expired
    holders = settle(["a", "c"], alive, APPS)
    assert counts(holders) == {"a": 6, "c": 6}
    assert all(holders[app] == alive[app] for app in alive)  # nothing else moved


def test_apps_no_longer_deployed_are_dropped_and_new_ones_taken() -> None:
    holders = settle(["a", "b"], {}, APPS)
    gone = sorted(a for a, h in holders.items() if h == "a")[:2]
    apps = [app for app in APPS if app not in gone] + ["ws/new1", "ws/new2"]
    plan = moves(AppsView(["a", "b"], apps, holders), "a")
    assert plan.drop == frozenset(gone)
    holders = settle(["a", "b"], holders, apps)
    assert sorted(holders) == sorted(apps) and counts(holders) == {"a": 6, "b": 6}


def test_processes_under_their_shares_try_free_apps_in_different_orders() -> None:
    a = moves(AppsView(["a", "b", "c"], APPS, {}), "a").take
    b = moves(AppsView(["a", "b", "c"], APPS, {}), "b").take
    assert len(a) == len(b) == 4 and a != b
