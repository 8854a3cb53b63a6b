"""The in-process tier of a reader: chunks by index, the least recently used dropped past
its budget. Used where there is no disk tier, or the object cannot be kept on disk."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ember_worker.weights.origins.range_buffers import RangeBytes


class ChunkMemory:
    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._chunks: OrderedDict[int, RangeBytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, index: int) -> RangeBytes | None:
        with self._lock:
            data = self._chunks.get(index)
            if data is not None:
                self._chunks.move_to_end(index)
            return data

    def put(self, index: int, data: RangeBytes) -> None:
        if len(data) > self._budget:
            return
        with self._lock:
            previous = self._chunks.pop(index, None)
            if previous is not None:
                self._bytes -= len(previous)
            self._chunks[index] = data
            self._bytes += len(data)
            while self._bytes > self._budget:
                _, dropped = self._chunks.popitem(last=False)
                self._bytes -= len(dropped)
