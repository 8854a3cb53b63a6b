"""The object's origin as a reader asks it: the version the first `stat` fixes, and byte
ranges of exactly that version, retried with backoff and jitter when a failure is worth
retrying, each request timed so that later ones are sized to the origin (`RequestSizer`)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ember.errors import WeightsUnavailableError
from ember_worker.weights.origins.origin import ObjectVersion, Origin, TransientOriginError
from ember_worker.weights.origins.range_buffers import RangeBytes
from ember_worker.weights.reading.options import ReaderOptions
from ember_worker.weights.reading.read_counts import ReadCounts
from ember_worker.weights.reading.request_sizing import RequestSizer

_T = TypeVar("_T")

# What an origin may fail with that the next attempt may not: origins map connection errors,
# 5xx and short reads to TransientOriginError; the built-ins are a safety net.
_RETRIED = (TransientOriginError, ConnectionError, TimeoutError)


class OriginReads:
    def __init__(self, origin: Origin, options: ReaderOptions, counts: ReadCounts) -> None:
        self._origin = origin
        self._options = options
        self._counts = counts
        self.sizer = RequestSizer(
            options.chunk_bytes, max(1, options.max_request_bytes // options.chunk_bytes)
        )
        # Not the global generator: user code may have seeded it and expect its sequence.
        self._jitter = random.Random()
        self._version_lock = threading.Lock()
        self._version: ObjectVersion | None = None

    @property
    def url(self) -> str:
        return self._origin.url

    @property
    def version(self) -> ObjectVersion:
        """The version every read belongs to (stat once, on first use)."""
        with self._version_lock:
            if self._version is None:
                self._version = self._with_retries(
                    "checking the object's version", self._origin.stat
                )
            return self._version

    def read(self, start: int, end: int) -> RangeBytes:
        """Bytes [start, end) of the version, from the origin."""

        def attempt() -> RangeBytes:
            self._counts.add("origin_requests")
            first_byte: list[float] = []
            sent = time.monotonic()
            data = self._origin.read_range(
                start, end, self.version, on_first_byte=lambda: first_byte.append(time.monotonic())
            )
            if first_byte:
                self.sizer.record(len(data), first_byte[0] - sent, time.monotonic() - sent)
            self._counts.add("origin_bytes", len(data))
            return data

        return self._with_retries(f"reading bytes {start}-{end - 1}", attempt)

    def reset(self) -> None:
        """Reopen the origin's connections (after a snapshot restore they are dead)."""
        self._origin.reset()

    def _with_retries(self, what: str, attempt: Callable[[], _T]) -> _T:
        """Retry transient failures with exponential backoff and jitter; anything that says
        the object is missing, forbidden or changed is final at once."""
        attempts = self._options.retries + 1
        last: BaseException | None = None
        for number in range(attempts):
            try:
                return attempt()
            except _RETRIED as error:
                last = error
            if number + 1 < attempts:
                delay = self._options.backoff_seconds * 2**number
                time.sleep(delay * (0.5 + 0.5 * self._jitter.random()))
        raise WeightsUnavailableError(
            self.url, f"{what} failed {attempts} times; last error: {last}"
        ) from last
