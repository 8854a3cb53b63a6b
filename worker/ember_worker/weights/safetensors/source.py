"""What the safetensors view needs from whatever holds the bytes: ranged reads of one object.

The tiered cache (`ObjectReader`) satisfies this; tests use an in-memory double.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeAlias

# Bytes of a range: a writable buffer (bytearray, or a view of a private file mapping) lets a
# tensor be built on it without a copy; read-only bytes are copied first.
Data: TypeAlias = bytes | bytearray | memoryview


class RangeSource(Protocol):
    """One immutable object of `size` bytes at `url`, read by byte range."""

    # Read-only properties, so plain attributes and properties both satisfy the protocol.
    @property
    def url(self) -> str: ...

    @property
    def size(self) -> int: ...

    def read(self, start: int, end: int) -> Data:
        """Bytes [start, end) of the object, exactly end - start of them."""
        ...

    def peek(self, start: int, end: int) -> Data:
        """`read` for a small one-off range (a file's header): it need not bring whole
        chunks into the cache, and may keep nothing."""
        ...

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> Iterator[Data]:
        """The bytes of each range, in order; later ranges are already being fetched
        while earlier ones are consumed. Closing the iterator early drops the rest."""
        ...

    def prefetch(self, start: int = 0, end: int | None = None) -> concurrent.futures.Future[None]:
        """Warm bytes [start, end) (to the end of the object when `end` is None) into the
        cache; the future completes when they are in, or fails with the read's error."""
        ...

    def reset(self) -> None:
        """Drop and reopen connections, e.g. after the process was restored from a snapshot."""
        ...
