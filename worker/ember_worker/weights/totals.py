"""What this process read through weights readers, summed over every reader.

The replica sends these running totals with its heartbeats and the control plane turns
them into `ember:weights_*` counters. Process-wide and only ever growing, so a reader
closed or collected still counts; a process restored from a snapshot starts again from
zero (`reset`): the reads in its image were the original replica's.
"""

from __future__ import annotations

import threading

# The reader's own counts: chunk lookups, of which memory_hits and disk_hits were served
# by those tiers (the rest fetched from the origin), and the origin's requests and bytes.
NAMES = ("chunks", "memory_hits", "disk_hits", "origin_requests", "origin_bytes")


class ReadTotals:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(NAMES, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(NAMES, 0)


totals = ReadTotals()
