"""What every origin is: where an object named by URL really lives (S3, HTTP(S), a local
file: `s3`, `http`, `file`; `by_scheme` picks one for a URL).

An origin answers two questions: which version of the object is there now (`stat`), and what
are bytes [start, end) of exactly that version (`read_range`, which also tells through
`on_first_byte` when the answer began to arrive: the reader sizes its requests by that).
Failures worth retrying (a connection error, a 5xx, a short read) are `TransientOriginError`,
which the reader retries; everything else is one of the `ember.errors` weights errors,
naming the URL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ember.errors import WeightsChangedError, WeightsUnavailableError
from ember_worker.weights.origins.range_buffers import RangeBytes

FirstByte = Callable[[], None]


@dataclass(frozen=True)
class ObjectVersion:
    """One version of an object: its size, and a tag that changes whenever its content does
    (S3 and HTTP: the ETag, else Last-Modified; a local file: f"{size}-{mtime_ns}")."""

    size: int
    tag: str


class TransientOriginError(Exception):
    """A failure worth retrying: a connection error, a 5xx, or fewer bytes than asked.
    Not public: the reader turns it into `WeightsUnavailableError` when retries run out."""


class Origin(Protocol):
    """Reads one object by byte range, always of the version `stat` returned."""

    url: str

    @property
    def requests(self) -> int:
        """Range reads sent to the origin so far (every attempt, failed ones too)."""
        ...

    @property
    def bytes_read(self) -> int:
        """Bytes of content the origin delivered in full ranges."""
        ...

    def stat(self) -> ObjectVersion: ...

    def read_range(
        self,
        start: int,
        end: int,
        version: ObjectVersion,
        *,
        on_first_byte: FirstByte | None = None,
    ) -> RangeBytes:
        """Bytes [start, end) of `version`; `on_first_byte()` is called, from any thread,
        when the answer's headers have arrived (origins without a wait need not call it)."""
        ...

    def reset(self) -> None:
        """Close clients and connections (before a snapshot; after a restore they are dead).
        The next read opens new ones."""
        ...


class CountedOrigin:
    """Thread-safe counts of what an origin was asked, so tests and stats can tell how many
    fetches really happened. `stat_requests` counts version checks (HEAD and the like)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._count_lock = threading.Lock()
        self._requests = 0
        self._stat_requests = 0
        self._bytes_read = 0

    @property
    def requests(self) -> int:
        with self._count_lock:
            return self._requests

    @property
    def stat_requests(self) -> int:
        with self._count_lock:
            return self._stat_requests

    @property
    def bytes_read(self) -> int:
        with self._count_lock:
            return self._bytes_read

    def _count_read(self) -> None:
        with self._count_lock:
            self._requests += 1

    def _count_stat(self) -> None:
        with self._count_lock:
            self._stat_requests += 1

    def _deliver(
        self, data: RangeBytes, start: int, end: int, *, longer: bool = False
    ) -> RangeBytes:
        """The asked bytes, counted; a short answer (truncated object, cut connection) is
        transient, since the next attempt may well get everything."""
        wanted = end - start
        if len(data) < wanted:
            raise TransientOriginError(
                f"short read: got {len(data)} of {wanted} bytes at offset {start}"
            )
        if len(data) > wanted or longer:
            sent = f"more than {wanted}" if longer else str(len(data))
            raise WeightsUnavailableError(
                self.url, f"the origin sent {sent} bytes for a range of {wanted}"
            )
        with self._count_lock:
            self._bytes_read += wanted
        return data


def changed_at_origin(url: str, what: str) -> WeightsChangedError:
    return WeightsChangedError(url, f"the object changed at the origin while being read ({what})")


def check_total_size(url: str, total: int | None, version: ObjectVersion) -> None:
    if total is not None and total != version.size:
        raise changed_at_origin(url, f"its size is now {total} bytes, not {version.size}")


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """`bytes first-last/total` (total may be `*`) -> (first, last, total); None if malformed."""
    if value is None:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes":
        return None
    try:
        return int(first), int(last), None if total == "*" else int(total)
    except ValueError:
        return None
