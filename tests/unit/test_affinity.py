"""Affinity routing: a key's home replica, how keys move as replicas come and go, and
how the control plane places keyed inputs (home first, elsewhere when it is full) without
keeping spare replicas from scaling down."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_harness import Env, run

from ember.calling.affinity import affinity_headers, check_affinity_key
from ember.errors import InvalidError
from ember_platform.edge.errors import HttpError
from ember_platform.http.call_requests import affinity_key
from ember_platform.runtime.affinity import HomeSlots, home_replica, key_from_argument
from ember_platform.runtime.cluster_model import ReplicaState

KEYS = [f"session-{n}" for n in range(600)]


@dataclass(frozen=True)
class Fake:
    id: str
    ready_at: float | None


def replicas(count: int) -> list[Fake]:
    return [Fake(f"r-{n}", float(n)) for n in range(count)]


def homes(ready: list[Fake], slots: int = 100) -> dict[str, str]:
    return {key: home_replica(key, ready, slots).id for key in KEYS}  # type: ignore[union-attr]


def test_a_key_always_has_the_same_home_and_keys_spread_evenly() -> None:
    ready = replicas(3)
    first = homes(ready)
    assert homes(list(reversed(ready))) == first  # the order replicas are listed in
    counts = Counter(first.values())
    assert set(counts) == {"r-0", "r-1", "r-2"}
    assert all(150 <= count <= 250 for count in counts.values()), counts


def test_a_new_replica_takes_only_its_share_and_a_gone_one_gives_up_only_its_own() -> None:
    before = homes(replicas(3))
    grown = homes(replicas(4))
    moved = [key for key in KEYS if grown[key] != before[key]]
    assert {grown[key] for key in moved} == {"r-3"}  # every moved key went to the new one
    assert 100 <= len(moved) <= 200  # about a quarter
    survivors = [r for r in replicas(3) if r.id != "r-1"]
    shrunk = homes(survivors)
    assert all(shrunk[key] == before[key] for key in KEYS if before[key] != "r-1")


def test_keys_spread_only_over_the_home_slots_longest_ready_replicas() -> None:
    ready = replicas(4)
    assert set(homes(ready, slots=1).values()) == {"r-0"}
    assert set(homes(ready, slots=2).values()) == {"r-0", "r-1"}
    assert home_replica("k", [], 3) is None


def test_home_slots_grow_at_once_and_shrink_only_after_the_window() -> None:
    slots = HomeSlots()
    slots.update(demand=0, per_replica=4, now=0.0, window=10.0)
    assert slots.count == 1
    slots.update(demand=9, per_replica=4, now=1.0, window=10.0)
    assert slots.count == 3
    slots.update(demand=2, per_replica=4, now=5.0, window=10.0)
    assert slots.count == 3  # the load wavers: keys stay where they are
    slots.update(demand=12, per_replica=4, now=8.0, window=10.0)  # needed 3 again
    slots.update(demand=2, per_replica=4, now=17.0, window=10.0)
    assert slots.count == 3
    slots.update(demand=2, per_replica=4, now=18.5, window=10.0)
    assert slots.count == 1


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "1 to 256 bytes"),
        ("x" * 257, "1 to 256 bytes"),
        ("tab\there", "printable ASCII"),
        ("café", "printable ASCII"),
    ],
)
def test_a_bad_key_is_refused_before_sending_and_by_the_gateway(key: str, message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        affinity_headers(key)
    with pytest.raises(HttpError, match=message) as caught:
        affinity_key({b"x-ember-affinity": key.encode("utf-8")})
    assert caught.value.status == 400


def test_a_good_key_passes_through() -> None:
    assert check_affinity_key("user:42/chat-7") == "user:42/chat-7"
    with pytest.raises(InvalidError, match="starts nor ends with a space"):
        check_affinity_key(" chat")  # a header would drop the space
    assert affinity_headers(None) == {}
    assert affinity_key({}) is None


def test_an_argument_gives_a_key_as_it_is_or_as_a_digest() -> None:
    assert key_from_argument("chat-7") == "chat-7"
    assert key_from_argument(42) == "42"
    long = key_from_argument("x" * 1000)
    assert long is not None and long.startswith("sha256:") and len(long) == 71
    assert key_from_argument("x" * 1000) == long  # the same text, the same key
    assert key_from_argument("café").startswith("sha256:")  # type: ignore[union-attr]
    for nothing in (None, "", True, 1.5, {"a": 1}, ["a"]):
        assert key_from_argument(nothing) is None


def routed(env: Env, placement: str) -> float:
    value = env.cluster.metrics.registry.get_sample_value(
        "ember:affinity_inputs_total",
        {"app": "demo", "endpoint": "fn", "placement": placement},
    )
    return value or 0.0


def test_keyed_inputs_go_home_and_elsewhere_only_when_home_is_full(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2, max_replicas=2)
        burst = [env.submit() for _ in range(4)]
        one, two = env.start_ready()
        env.tick()  # the load needs both: keys spread over both
        assert env.runtime.home_slots.count == 2
        for inp in burst:
            env.reply(one if inp.replica_id == one.id else two, "result", inp, b"0")
        by_home: dict[str, list[str]] = {one.id: [], two.id: []}
        for key in KEYS[:40]:
            by_home[home_replica(key, [one, two], 2).id].append(key)  # type: ignore[union-attr]
        assert by_home[one.id] and by_home[two.id]
        for key in by_home[one.id][:5] + by_home[two.id][:5]:
            inp = env.submit(affinity=key)
            assert inp.replica_id == home_replica(key, [one, two], 2).id  # type: ignore[union-attr]
            env.reply(one if inp.replica_id == one.id else two, "result", inp, b"0")
        assert routed(env, "home") == 10
        assert routed(env, "elsewhere") == 0
        # Fill `one` with its own keys: the next of its keys runs on `two` instead.
        first, second = (env.submit(affinity=key) for key in by_home[one.id][:2])
        assert first.replica_id == second.replica_id == one.id
        spilled = env.submit(affinity=by_home[one.id][2])
        assert spilled.replica_id == two.id
        assert routed(env, "elsewhere") == 1
        assert env.submit(affinity=by_home[two.id][0]).replica_id == two.id
        waiting = env.submit(affinity=by_home[one.id][3])  # both full: it waits
        assert waiting.replica_id is None
        env.reply(one, "result", first, b"0")  # its home frees first: it goes home
        assert waiting.replica_id == one.id

    run(tmp_path, scenario)


def test_keyed_traffic_lets_a_spare_replica_scale_down(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(concurrency=2, max_replicas=2, scaledown_window=10.0)
        burst = [env.submit() for _ in range(4)]
        one, two = env.start_ready()
        t0 = time.time()
        env.advance(t0)
        for inp in burst:
            env.reply(one if inp.replica_id == one.id else two, "result", inp, b"0")
            (one if inp.replica_id == one.id else two).idle_since = t0
        # One call a second, each with a new key: a load one replica carries.
        for second in range(40):
            now = t0 + 1 + second
            inp = env.submit(affinity=KEYS[second])
            served = one if inp.replica_id == one.id else two
            env.reply(served, "result", inp, b"0")
            served.idle_since = now  # on the test's clock
            env.advance(now)
        assert env.runtime.home_slots.count == 1
        live = [r for r in env.runtime.replicas.values() if r.state is ReplicaState.READY]
        assert live == [one]  # `two` went idle once keys left it, and scaled down

    run(tmp_path, scenario)
