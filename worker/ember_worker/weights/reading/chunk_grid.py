"""Where an object's chunks lie, `[i * chunk, min((i + 1) * chunk, size))`, which of them a
byte range touches, and the chunks a sequence of reads needs, each listed once."""

from __future__ import annotations

from collections.abc import Sequence

from ember.errors import WeightsFormatError
from ember_worker.weights.reading.origin_reads import OriginReads


class ChunkGrid:
    def __init__(self, chunk_bytes: int, origin: OriginReads) -> None:
        self.chunk_bytes = chunk_bytes
        self._origin = origin  # the object's size, from its version

    def span(self, start: int, end: int) -> range:
        """The indices of the chunks [start, end) touches, after checking the range."""
        size = self._origin.version.size
        if not 0 <= start <= end <= size:
            raise WeightsFormatError(
                self._origin.url, f"range [{start}, {end}) beyond the object's {size} bytes"
            )
        if start == end:
            return range(0)
        chunk = self.chunk_bytes
        return range(start // chunk, (end - 1) // chunk + 1)

    def bounds(self, index: int) -> tuple[int, int]:
        """Chunk `index`'s bytes [start, end) in the object."""
        chunk = self.chunk_bytes
        return index * chunk, min((index + 1) * chunk, self._origin.version.size)


def plan_reads(spans: Sequence[range]) -> tuple[list[int], list[tuple[int, int]]]:
    """The chunks a sequence of reads needs, in order, a chunk shared by two neighbouring
    reads (tensors meeting inside it) listed once; and each read's positions [low, high)
    in that list."""
    plan: list[int] = []
    places: list[tuple[int, int]] = []
    for span in spans:
        low = len(plan)
        indices = list(span)
        if indices and plan and plan[-1] == indices[0]:
            low -= 1
            indices = indices[1:]
        plan.extend(indices)
        places.append((low, len(plan)))
    return plan, places
