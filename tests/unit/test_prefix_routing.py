"""Prefix-aware routing's policy (scaling/prefix_routing.py): block hashes of prompts,
and the replica a request goes to."""

from __future__ import annotations

import pytest

import ember
from ember.errors import InvalidError
from ember_platform.scaling.prefix_routing import (
    BLOCK_BYTES,
    PrefixIndex,
    Routed,
    block_hashes,
    prompt_text,
    routing_load,
)


def chat(*contents: str) -> bytes:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    messages = [
        {"role": role, "content": text} for role, text in zip(roles, contents, strict=False)
    ]
    text = prompt_text({"messages": messages})
    assert text is not None
    return text


def test_equal_prefixes_hash_alike_and_a_change_ends_the_match() -> None:
    system = "You are a careful assistant. " * 20
    first, second = block_hashes(chat(system, "hi")), block_hashes(chat(system, "hi", "ok", "more"))
    assert first and second[: len(first)] == first  # a conversation's next turn
    other = block_hashes(chat("You are a terse assistant. " + system, "hi"))
    assert other[0] != first[0]  # chained: a change in block 0 changes every block after
    assert block_hashes(b"x" * (BLOCK_BYTES - 1)) == ()  # a partial block is not cached


def test_prompt_text_reads_chats_and_prompts_and_nothing_else() -> None:
    assert prompt_text({"prompt": "Once upon"}) == b"Once upon"
    ids = prompt_text({"prompt": [1, 22, 333]})
    assert ids is not None and prompt_text({"prompt": [1, 22, 333, 4]}).startswith(ids)  # type: ignore[union-attr]
    parts = [{"type": "text", "text": "hi"}]
    assert prompt_text({"messages": [{"role": "user", "content": parts}]}) is not None
    for arguments in ({}, [], {"messages": ["not a message"]}, {"prompt": 3}, {"x": "y"}):
        assert prompt_text(arguments) is None


def test_a_request_goes_where_its_longest_prefix_was_served() -> None:
    index = PrefixIndex()
    turn1 = block_hashes(chat("persona one " * 30, "hello"))
    turn2 = block_hashes(chat("persona one " * 30, "hello", "hi!", "and now?"))
    other = block_hashes(chat("persona two " * 30, "hello"))
    loads = {"r-a": 0, "r-b": 0}
    # A prompt no replica holds: none chosen, placed as any call is (Queues).
    assert index.choose(turn1, loads, busy_at=2) == (None, Routed.NEW)
    index.served("r-a", turn1)
    index.served("r-b", other)
    assert index.choose(turn2, {"r-a": 1, "r-b": 0}, busy_at=2) == ("r-a", Routed.CACHED)
    assert index.choose(other, {"r-a": 0, "r-b": 1}, busy_at=2) == ("r-b", Routed.CACHED)
    # Busy: the least loaded instead (of those, the one whose cache holds least).
    assert index.choose(turn2, {"r-a": 2, "r-b": 1}, busy_at=2) == ("r-b", Routed.BUSY)
    index.forget("r-b")
    assert index.choose(turn2, {"r-a": 2, "r-b": 0, "r-c": 0}, busy_at=2) == ("r-b", Routed.BUSY)
    # Only ready replicas with room count.
    assert index.choose(turn2, {"r-b": 0}, busy_at=2) == (None, Routed.NEW)
    assert index.choose(turn2, {}, busy_at=2) == (None, Routed.NEW)
    index.forget("r-a")
    assert index.choose(turn2, loads, busy_at=2) == (None, Routed.NEW)
    assert index.replicas() == 0


def test_an_engine_with_requests_waiting_counts_as_busy() -> None:
    # Its queue holds some of the running inputs: not added, but busy at least.
    assert routing_load(1, None, busy_at=4) == 1
    assert routing_load(1, 0.0, busy_at=4) == 1
    assert routing_load(1, 2.0, busy_at=4) == 4
    assert routing_load(6, 2.0, busy_at=4) == 6
    index = PrefixIndex()
    prompt = block_hashes(chat("persona one " * 30, "hello"))
    index.served("r-a", prompt)
    loads = {"r-a": routing_load(0, 3.0, busy_at=2), "r-b": routing_load(1, None, busy_at=2)}
    assert index.choose(prompt, loads, busy_at=2) == ("r-b", Routed.BUSY)


def test_each_replica_remembers_a_bounded_number_of_blocks_tails_out_first() -> None:
    index = PrefixIndex(blocks_per_replica=8)
    loads = {"r-a": 0, "r-b": 0}
    old = block_hashes(b"a" * BLOCK_BYTES * 4)
    index.served("r-a", old)
    index.served("r-a", block_hashes(b"b" * BLOCK_BYTES * 6))  # 10: old's last 2 go
    assert index.blocks() == 8
    assert index.choose(old, loads, busy_at=1) == ("r-a", Routed.CACHED)  # its head stays
    third = block_hashes(b"c" * BLOCK_BYTES * 8)
    index.served("r-a", third)  # 8 more: every block before them goes
    assert index.choose(old, loads, busy_at=1) == (None, Routed.NEW)
    assert index.choose(third, loads, busy_at=1) == ("r-a", Routed.CACHED)


def test_a_hit_ends_at_the_first_block_a_replica_lacks() -> None:
    index = PrefixIndex()
    long = block_hashes(b"x" * BLOCK_BYTES * 6)
    index.served("r-a", long[:2])  # the first two blocks
    index.served("r-b", long)  # all six
    assert index.choose(long, {"r-a": 0, "r-b": 1}, busy_at=4) == ("r-b", Routed.CACHED)
    index.forget("r-b")
    index.served("r-b", long[3:])  # blocks without their head: no hit of this prompt
    assert index.choose(long, {"r-a": 1, "r-b": 0}, busy_at=4) == ("r-a", Routed.CACHED)


def test_route_by_takes_prefix_or_nothing() -> None:
    assert ember.endpoint(route_by="prefix") is not None
    with pytest.raises(InvalidError, match=r"route_by='round-robin'.*use route_by='prefix'"):
        ember.endpoint(route_by="round-robin")
