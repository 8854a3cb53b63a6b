"""What one reader did, counted for its `stats()` and for the whole process (`totals`)."""

from __future__ import annotations

import threading

from ember_worker.weights.totals import totals

COUNTED = ("origin_requests", "origin_bytes", "disk_hits", "memory_hits", "chunks")


class ReadCounts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTED, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount
            totals.add(name, amount)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
