"""Progress of many calls or files (`ember bench`, `ember map`, `ember volume put`): a
tqdm bar on a terminal, a few plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Call `update(ok)` per finished request (or `noun`) and `close()` at the end; plain
    lines start with `command` ("bench: 50/100 requests done, 0 failed")."""

    def __init__(
        self,
        total: int | None,
        command: str,
        stream: TextIO | None = None,
        *,
        unit: str = "req",
        noun: str = "requests",
    ) -> None:
        self._stream = stream or sys.stderr
        self._command = command
        self._noun = noun
        self._total = total
        self._done = 0
        self._failed = 0
        self._bar: Any = None
        self._last_line = time.monotonic()
        self._next_share = 0.25
        if self._stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, unit=unit, file=self._stream, dynamic_ncols=True)

    def update(self, ok: bool) -> None:
        self._done += 1
        self._failed += 0 if ok else 1
        if self._bar is not None:
            self._bar.update(1)
            if self._failed:
                self._bar.set_postfix(failed=self._failed, refresh=False)
            return
        # Without a terminal: a line per quarter of the run, or every 10 s when open-ended.
        now = time.monotonic()
        if self._total:
            due = self._done >= self._total * self._next_share
            if due:
                while self._done >= self._total * self._next_share:
                    self._next_share += 0.25
        else:
            due = now - self._last_line >= 10
        if due:
            self._last_line = now
            of_total = f"/{self._total}" if self._total else ""
            print(
                f"{self._command}: {self._done}{of_total} {self._noun} done, {self._failed} failed",
                file=self._stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
