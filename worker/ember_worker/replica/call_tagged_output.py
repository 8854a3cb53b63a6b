"""A replica's stdout and stderr, each line tagged with the call it was printed for, so
that `ember logs APP --call ID` shows what one call printed among many running at once.

Each thread's output is held until its line is complete (or flushed), then written
whole behind a mark and the call's id, under a lock: the worker strips the mark into the
line's `call` field. Lines of threads running at once no longer cut into each other.
Lines of threads the code started belong to the one input running, when only one is.
Output written to the file descriptors directly (C code, subprocesses) is not tagged."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any, TextIO

# Starts a tagged line, and ends its call id: "\x1fc-abc\x1fthe text".
MARK = "\x1f"
MAX_CALL_ID = 64


def split_tag(line: str) -> tuple[str | None, str]:
    """The call id a line was tagged with (None if untagged), and its text."""
    if not line.startswith(MARK):
        return None, line
    call, found, text = line[1:].partition(MARK)
    if not found or not call.startswith("c-") or len(call) > MAX_CALL_ID:
        return None, line
    return call, text


class CallTaggedWriter:
    """Stands in for sys.stdout or sys.stderr; other attributes are the stream's own."""

    def __init__(self, stream: TextIO, current_call: Callable[[], str | None]) -> None:
        self._stream = stream
        self._current_call = current_call
        self._lock = threading.Lock()
        self._partial: dict[int, tuple[str | None, str]] = {}  # per thread: call, text

    def write(self, text: str) -> int:
        if not text:
            return 0
        thread = threading.get_ident()
        with self._lock:
            call, held = self._partial.pop(thread, (self._current_call(), ""))
            *lines, rest = (held + text).split("\n")
            if lines:
                self._stream.write("".join(_tagged(call, line) + "\n" for line in lines))
                call = self._current_call()  # a new line is the current call's
            if rest:
                self._partial[thread] = (call, rest)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            for call, text in self._partial.values():
                self._stream.write(_tagged(call, text) + "\n")
            self._partial.clear()
            self._stream.flush()

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


class CallOfLine:
    """Which call a line is printed for: the input the printing code runs for, or, for
    code that does not know (a thread the user's code started, which does not inherit
    its context), the one input running, if only one is. With several running such a
    line stays untagged: it could be any of theirs."""

    def __init__(self, current_call: Callable[[], str | None]) -> None:
        self._current_call = current_call
        self.running: Callable[[], Collection[str]] = tuple  # set once inputs can run

    def __call__(self) -> str | None:
        call = self._current_call()
        if call is not None:
            return call
        try:
            running = list(self.running())  # read from any thread: a copy, at once
        except RuntimeError:  # changed while copied: too busy to say
            return None
        return running[0] if len(running) == 1 else None


def _tagged(call: str | None, line: str) -> str:
    return line if call is None else f"{MARK}{call}{MARK}{line}"
