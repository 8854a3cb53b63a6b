"""Progress of a weights read: to a callback, or else a tqdm bar on a terminal, or else log
lines."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

ProgressCallback = Callable[[int, int], None]
"""Called as `on_progress(done_bytes, total_bytes)` after each tensor is read."""

_log = logging.getLogger("ember.weights")


class _Progress:
    """Reports bytes read to `on_progress`, or else to a tqdm bar on a terminal, or else
    as a log line at the start and at the end."""

    def __init__(
        self, url: str, total: int, count: int, on_progress: ProgressCallback | None
    ) -> None:
        self._url = url
        self._total = total
        self._done = 0
        self._on_progress = on_progress
        self._bar: Any = None  # a tqdm bar; tqdm is imported only on a terminal
        self._started = time.monotonic()
        if on_progress is not None:
            return
        if _stderr_is_terminal():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=_short(url)
            )
        else:
            _log.info("reading %s: %d tensors, %.1f MB", url, count, total / 1e6)

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        if self._on_progress is not None:
            self._on_progress(self._done, self._total)
        elif self._bar is not None:
            self._bar.update(nbytes)

    def close(self, *, finished: bool) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._on_progress is None and finished:
            seconds = time.monotonic() - self._started
            megabytes = self._done / 1e6
            _log.info(
                "read %s: %.1f MB in %.2f s (%.1f MB/s)",
                self._url,
                megabytes,
                seconds,
                megabytes / max(seconds, 1e-6),
            )


def _short(url: str) -> str:
    # The bar's label: the end of the URL names the file, the start only the bucket.
    return url if len(url) <= 40 else "..." + url[-37:]


def _stderr_is_terminal() -> bool:
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()
