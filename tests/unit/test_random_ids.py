"""Ids drawn from the random pool: never the same bytes twice, in a process or after fork."""

from __future__ import annotations

import os
import re

from ember_platform.security.random_ids import POOL_BYTES, random_bytes, random_token


def test_tokens_are_url_safe_text_of_the_asked_length() -> None:
    tokens = {random_token(12) for _ in range(2000)}
    assert len(tokens) == 2000
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{16}", token) for token in tokens)


def test_draws_across_a_refill_do_not_repeat() -> None:
    draws = [random_bytes(24) for _ in range(3 * POOL_BYTES // 24 + 5)]
    assert len(set(draws)) == len(draws)
    assert len(random_bytes(POOL_BYTES + 1)) == POOL_BYTES + 1  # more than a pool at once


def test_a_forked_child_never_hands_out_its_parents_next_bytes() -> None:
    random_bytes(1)  # the pool is filled: a child given a copy would repeat what follows
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's side
        os.write(write_end, random_bytes(32))
        os._exit(0)
    os.close(write_end)
    childs = os.read(read_end, 32)
    os.close(read_end)
    os.waitpid(child, 0)
    assert len(childs) == 32
    assert childs != random_bytes(32)
