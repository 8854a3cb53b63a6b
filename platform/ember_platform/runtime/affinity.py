"""Affinity routing: the replica an input with an affinity key (X-Ember-Affinity) goes to.

Rendezvous (highest random weight) hashing: a key ranks each replica by a hash of the
two and belongs to the top one, its home. When a replica joins or leaves, only the keys
it wins or held move; every other key keeps its home and what that replica cached.

The candidates are the endpoint's home replicas: the longest-ready ones, as many as the
load needs (`HomeSlots`), not every ready one. Keys spread over all of them would keep
each one busy, and none would sit idle for its scale-down window. Replicas past the home
set take a keyed input only when its home is full; when the load falls they go idle and
scale down as usual.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ember.calling.affinity import check_affinity_key
from ember.errors import InvalidError


class Candidate(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def ready_at(self) -> float | None: ...


ReplicaT = TypeVar("ReplicaT", bound=Candidate)


def key_from_argument(value: object) -> str | None:
    """The affinity key an argument gives (`@ember.method(affinity_field=...)`): a
    string or an integer as it is, or, if it is not a valid key as it is (long, not
    ASCII), a digest of it; None for anything else (absent, null, an object)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    if not text:
        return None
    try:
        return check_affinity_key(text)
    except InvalidError:
        return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def key_weight(key: str, replica_id: str) -> int:
    """The key's rank for the replica: the same on every control plane and run."""
    digest = hashlib.blake2b(f"{replica_id}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home_replica(key: str, ready: Sequence[ReplicaT], slots: int) -> ReplicaT | None:
    """The key's home among the `slots` longest-ready of `ready` (None if none is)."""
    homes = sorted(ready, key=lambda r: (r.ready_at or 0.0, r.id))[: max(1, slots)]
    return max(homes, key=lambda r: key_weight(key, r.id), default=None)


@dataclass
class HomeSlots:
    """How many replicas keys are spread over. It grows at once with the load and
    shrinks only after the load has needed fewer for the scale-down window, so keys do
    not hop between replicas (losing their caches) as the load wavers."""

    count: int = 1
    needed_at: float = 0.0  # when the load last needed `count`

    def update(self, demand: int, per_replica: int, now: float, window: float) -> None:
        """`demand` inputs queued and running, `per_replica` each (the scaling target)."""
        needed = max(1, math.ceil(demand / max(1, per_replica)))
        if needed >= self.count or now - self.needed_at >= window:
            self.count = needed
            self.needed_at = now
