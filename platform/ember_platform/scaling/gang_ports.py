"""The ports a gang's members listen on for each other: one block per gang, none shared
by two live gangs of the platform (two nodes may be one machine, its loopback theirs)."""

from __future__ import annotations

from collections.abc import Iterable

# Below Linux's ephemeral range (32768 on), which the node's own connections take from.
GANG_PORTS = (24_000, 32_000)  # [first, end)
# What one workspace's gangs may hold at once: a quarter, so that no tenant's gangs can
# leave none for the others' (a gang's own at most: settings.MAX_GANG_PORTS_IN_ALL).
GANG_PORTS_PER_WORKSPACE = 2048


def free_block(
    size: int, taken: Iterable[tuple[int, int]], ports: tuple[int, int] = GANG_PORTS
) -> int | None:
    """The first port of `size` free ports in a row within `ports`, given the blocks
    `taken` ((first, size) each); None where none is free."""
    first, end = ports
    at = first
    for start, length in sorted(taken):
        if start - at >= size:
            break
        at = max(at, start + length)
    return at if at + size <= end else None
