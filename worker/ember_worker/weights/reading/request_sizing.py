"""How many adjacent chunks one origin request should carry, learnt from the origin's answers.

A range request costs a wait before its first byte (a round trip, the store finding the
object, a queue at the server) and then its bytes at the connection's rate. Chunks are
sized for an origin that answers at once (16 MiB: AWS's advice for S3, and the fastest
over a local nginx). Against an origin whose wait outweighs a chunk's transfer, small
requests spend most of their time waiting; there, adjacent chunks of one read go out as
one request, large enough that its wait is no longer than its transfer
(bytes >= wait x rate), up to a bound. Chunks stay the unit of the caches either way.

Every request until there are samples, and every read that is not sequential, is one chunk.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque


class RequestSizer:
    """The median wait-before-first-byte and per-connection rate of the latest answers
    (medians: one request stuck behind a pause must not reshape the next ones); thread-safe."""

    def __init__(
        self, chunk_bytes: int, max_chunks: int, *, window: int = 9, min_samples: int = 2
    ) -> None:
        if chunk_bytes < 1 or max_chunks < 1 or window < 1 or min_samples < 1:
            raise ValueError("chunk_bytes, max_chunks, window and min_samples must be >= 1")
        self._chunk_bytes = chunk_bytes
        self._max_chunks = max_chunks
        self._min_samples = min_samples
        self._lock = threading.Lock()
        self._waits: deque[float] = deque(maxlen=window)
        self._rates: deque[float] = deque(maxlen=window)

    def record(self, size: int, first_byte_seconds: float, total_seconds: float) -> None:
        """One answered request: `size` bytes, its first after `first_byte_seconds`, its
        last after `total_seconds` (both from when it was sent). Nonsense is ignored."""
        if size <= 0 or first_byte_seconds < 0 or total_seconds <= 0:
            return
        wait = min(first_byte_seconds, total_seconds)
        # A body that arrived with its headers says nothing of the rate but "fast".
        transfer = max(total_seconds - wait, 1e-6)
        with self._lock:
            self._waits.append(wait)
            self._rates.append(size / transfer)

    def chunks_per_request(self) -> int:
        """How many adjacent chunks the next sequential request should cover (>= 1)."""
        estimate = self.estimate()
        if self._max_chunks == 1 or estimate is None:
            return 1
        wait, rate = estimate
        worth = wait * rate  # the bytes a connection could have carried while it waited
        # Rounded down: a wait shorter than two chunks' transfer is not worth fewer requests.
        return max(1, min(self._max_chunks, math.floor(worth / self._chunk_bytes)))

    def estimate(self) -> tuple[float, float] | None:
        """(wait seconds, bytes per second), medians of the latest answers; None until
        there are `min_samples` of them."""
        with self._lock:
            if len(self._waits) < self._min_samples:
                return None
            return statistics.median(self._waits), statistics.median(self._rates)
