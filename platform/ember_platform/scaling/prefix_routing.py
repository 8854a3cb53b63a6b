"""Prefix-aware routing: the replica whose engine most likely still holds a request's
prompt prefix in its cache (`@ember.endpoint(route_by="prefix")`).

An LLM engine keeps the key-value cache of the prompts it served in blocks, each keyed
by a hash chained over the blocks before it (vLLM's automatic prefix caching), and evicts
the least recently used. A conversation or an agent sends the same, growing prompt turn
after turn: on the replica that served its last turn most of it is cached, on any other
it is computed anew. So the gateway keeps, per endpoint, the block hashes each replica
served lately, keyed and evicted the same way (a bounded number per replica, least
recently used first), and a request goes to the replica with the longest prefix of it
cached (from its first block on: an engine's hit ends at the first block it lacks),
unless that replica already runs `busy_at` inputs or more, or its engine says requests
wait in its own queue (`routing_load`): then to the least loaded. A prompt no replica
holds is placed as any call is (packed below the endpoint's target, so that spare
replicas still go idle and scale down).

Blocks are of the request's text (an OpenAI request's messages, or its prompt), not its
tokens: the gateway has no tokenizer, and a text prefix shared is a token prefix shared.

Pure: no clock, no I/O; the caller says which replicas are ready and how loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

BLOCK_BYTES = 128  # about 32 tokens of English text; vLLM's blocks are 16 tokens
MAX_PROMPT_BLOCKS = 2048  # the first 256 KiB of a prompt are routed on
BLOCKS_PER_REPLICA = 16_384  # remembered per replica: about 2 MiB of prompt text
HASH_BYTES = 8


# The gauges by which an engine says how many requests wait in its own queue (its KV cache
# is full, or its batch is): vLLM's and SGLang's, read from the replica's latest scrape
# when the endpoint exports its engine's metrics (`engine_metrics=`).
ENGINE_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


def routing_load(running: int, engine_waiting: float | None, busy_at: int) -> int:
    """A replica's load as prefix routing weighs it: its running inputs, but at least
    `busy_at` while its engine has requests waiting (a request sent there for its cache
    would wait behind them; the engine's queue holds some of the running inputs, so it is
    not added to them)."""
    if engine_waiting is not None and engine_waiting > 0:
        return max(running, busy_at)
    return running


class Routed(StrEnum):
    """How a request with a prompt was placed (counted in ember:prefix_routed_total)."""

    CACHED = "cached"  # to the replica with the longest cached prefix
    BUSY = "busy"  # that replica was busy: to the least loaded
    NEW = "new"  # no ready replica holds a block of it: to the least loaded


def prompt_text(arguments: Any) -> bytes | None:
    """The text an engine's prefix cache keys a request by, in order: an OpenAI chat
    request's messages (role and content), or a completion's prompt (text or token ids);
    None for arguments with neither."""
    if not isinstance(arguments, dict):
        return None
    messages = arguments.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            parts.append(f"{message.get('role')}\x00{text}\x01")
        return "".join(parts).encode()
    prompt = arguments.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and all(type(item) is int for item in prompt):
        return "".join(f"{item} " for item in prompt).encode()  # a prefix's text is a prefix
    return None


def block_hashes(text: bytes) -> tuple[bytes, ...]:
    """A hash of each full block of `text`, the i-th chained over blocks 0..i: equal
    i-th hashes mean equal prefixes of i + 1 blocks. A last partial block is not
    cached by an engine, and not hashed."""
    hashes = []
    previous = b""
    end = min(len(text) // BLOCK_BYTES, MAX_PROMPT_BLOCKS) * BLOCK_BYTES
    for start in range(0, end, BLOCK_BYTES):
        block = text[start : start + BLOCK_BYTES]
        previous = hashlib.blake2b(block, digest_size=HASH_BYTES, key=previous).digest()
        hashes.append(previous)
    return tuple(hashes)


@dataclass
class PrefixIndex:
    """The block hashes each replica of one endpoint served lately."""

    blocks_per_replica: int = BLOCKS_PER_REPLICA
    # hash -> the replicas that hold it; per replica, its hashes, least recent first.
    _holders: dict[bytes, set[str]] = field(default_factory=dict)
    _by_replica: dict[str, OrderedDict[bytes, None]] = field(default_factory=dict)

    def served(self, replica: str, hashes: tuple[bytes, ...]) -> None:
        """`replica` took a request of these blocks: they are its most recent, its first
        block the most recent of all, so that eviction takes a prompt's tail before its
        head (as vLLM does: a cached prefix stays one, only shorter)."""
        held = self._by_replica.setdefault(replica, OrderedDict())
        for block in reversed(hashes):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
                self._holders.setdefault(block, set()).add(replica)
        while len(held) > self.blocks_per_replica:
            evicted, _ = held.popitem(last=False)
            self._drop(evicted, replica)

    def forget(self, replica: str) -> None:
        """The replica is gone, and its cache with it."""
        for block in self._by_replica.pop(replica, {}):
            self._drop(block, replica)

    def _drop(self, block: bytes, replica: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block]

    def choose(
        self, hashes: tuple[bytes, ...], loads: Mapping[str, int], busy_at: int
    ) -> tuple[str | None, Routed]:
        """The replica for a request of these blocks, of the ready ones with room (their
        running inputs in `loads`), and why. None for a prompt no replica holds (NEW): it
        is placed as any call is, packed onto busy replicas below the endpoint's target
        so that spare ones go idle and scale down."""
        # The replicas holding the longest run of the request's blocks from its first: an
        # engine's cache hit ends at the first block it lacks.
        longest = {r for r in self._holders.get(hashes[0], ()) if r in loads} if hashes else set()
        for block in hashes[1:]:
            holders = self._holders.get(block, ())
            if not any(replica in holders for replica in longest):
                break
            longest = {replica for replica in longest if replica in holders}
        if not longest:
            return None, Routed.NEW
        best = min(longest, key=loads.__getitem__)
        if loads[best] < busy_at:
            return best, Routed.CACHED
        # Of the least loaded, the one whose cache holds least.
        return min(loads, key=lambda r: (loads[r], len(self._by_replica.get(r, ())))), Routed.BUSY

    def replicas(self) -> int:
        return len(self._by_replica)

    def blocks(self) -> int:
        return sum(len(held) for held in self._by_replica.values())
