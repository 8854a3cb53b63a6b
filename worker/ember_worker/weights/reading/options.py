"""How an `ObjectReader` reads: its chunk size, the origin requests it keeps in flight and
how large one may grow, its retries, and the budget of its in-process tier."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReaderOptions:
    chunk_bytes: int = 16 * 2**20
    concurrency: int = 16  # origin requests in flight (a stream: at most 2x this in chunks)
    # The most one request may carry when adjacent chunks are asked for together.
    # chunk_bytes (or less): one chunk per request, always.
    max_request_bytes: int = 64 * 2**20
    retries: int = 4
    backoff_seconds: float = 0.1
    memory_bytes: int = 512 * 2**20  # the in-process tier's budget

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, not {self.chunk_bytes}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {self.concurrency}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, not {self.max_request_bytes}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, not {self.retries}")
        if self.backoff_seconds < 0:
            raise ValueError(f"backoff_seconds must be >= 0, not {self.backoff_seconds}")
        if self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, not {self.memory_bytes}")


DEFAULT_OPTIONS = ReaderOptions()
