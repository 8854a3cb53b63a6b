"""Replica and platform log lines, kept per app as JSON lines and streamed to followers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

MAX_LOG_BYTES = 64 * 1024 * 1024  # per app file before it is rotated once
READ_BLOCK = 256 * 1024
# Request lines are buffered for up to a flush interval, so the files are only roughly
# in time order; a history read for `since` goes this far past it before it stops.
ORDER_SLACK_SECONDS = 60.0
# Lines a follower (`ember logs -f`) may have waiting: past it, one that reads slower
# than the app prints misses lines, and a line says how many.
FOLLOW_LINES = 10_000
log = logging.getLogger("ember.logs")
_encoder = msgspec.json.Encoder()


def json_lines(entries: list[dict[str, Any]]) -> bytes:
    """Entries as JSON lines, by msgspec (a request line each call: json.dumps cost 4 us
    of the control plane's CPU per call); what it refuses (text with a lone surrogate, a
    value of no JSON type) by json, which escapes it."""
    try:
        return b"".join([_encoder.encode(entry) + b"\n" for entry in entries])
    except (msgspec.EncodeError, TypeError, UnicodeEncodeError):
        return "".join(json.dumps(entry, default=str) + "\n" for entry in entries).encode()


@dataclass(frozen=True)
class LogFilter:
    """Which lines a reader wants. Applied before `tail` counts lines, so `-n 50` with a
    replica gives that replica's last 50 lines, however busy the rest of the app is."""

    endpoint: str | None = None
    replica: str | None = None
    since: float | None = None  # a Unix time
    # One call's lines: what its code printed, its request line, and those of the calls
    # it made.
    call: str | None = None
    grep: str | None = None  # text the line must hold, in any case (`ember logs --grep`)
    trace: str | None = None  # the request lines of one trace (W3C trace id)

    def matches(self, entry: dict[str, Any]) -> bool:
        if self.trace is not None and entry.get("trace_id") != self.trace:
            return False
        if (
            self.grep is not None
            and self.grep.casefold() not in str(entry.get("text", "")).casefold()
        ):
            return False
        if self.endpoint is not None and entry.get("endpoint") != self.endpoint:
            return False
        if self.replica is not None and not str(entry.get("replica") or "").startswith(
            self.replica
        ):  # an id, or its first characters as `ember replica` takes them
            return False
        if self.call is not None and self.call not in (
            entry.get("call"),
            entry.get("request_id"),
            entry.get("parent_id"),
        ):
            return False
        return self.since is None or float(entry.get("ts", 0)) >= self.since


def lines_backwards(path: Path) -> Iterator[bytes]:
    """A file's lines, last first, read in blocks so a large file is not read whole."""
    with path.open("rb") as handle:
        position = handle.seek(0, 2)
        partial = b""
        while position > 0:
            step = min(READ_BLOCK, position)
            position -= step
            handle.seek(position)
            chunk = handle.read(step) + partial
            lines = chunk.split(b"\n")
            partial = lines.pop(0)  # may continue in the block before
            yield from reversed(lines)
        yield partial


class LogSink:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._followers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = defaultdict(set)
        self._missed: dict[asyncio.Queue[dict[str, Any]], int] = {}  # lines, by follower
        self._buffered: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
        self._unwritable: set[str] = set()  # apps whose last write failed (said once)

    def _path(self, app: str) -> Path:
        return self.root / f"{app}.jsonl"

    def write(self, app: str, entries: list[dict[str, Any]]) -> None:
        if not entries:
            return
        try:
            self._append(app, entries)
        except OSError as error:  # a full disk: followers still get the lines
            if app not in self._unwritable:
                log.warning(
                    "log lines of app %s are not kept on disk until it has room: %s",
                    app,
                    error.strerror or error,
                )
            self._unwritable.add(app)
        else:
            if app in self._unwritable:
                self._unwritable.discard(app)
                log.warning("log lines of app %s are kept on disk again", app)
        for queue in self._followers.get(app, ()):
            self._pass_on(queue, entries)

    def _pass_on(self, queue: asyncio.Queue[dict[str, Any]], entries: list[dict[str, Any]]) -> None:
        """The lines to a follower, as many as its queue has room for; those it missed
        are counted, and said once it has room again."""
        missed = self._missed.pop(queue, 0)
        for entry in entries:
            if missed and queue.qsize() < queue.maxsize - 1:
                text = f"ember: {missed} lines were not followed: they came faster than read"
                queue.put_nowait({"ts": time.time(), "stream": "ember", "text": text})
                missed = 0
            try:
                queue.put_nowait(entry)
            except asyncio.QueueFull:
                missed += 1
        if missed:
            self._missed[queue] = missed

    def _append(self, app: str, entries: list[dict[str, Any]]) -> None:
        path = self._path(app)
        if path.exists() and path.stat().st_size > MAX_LOG_BYTES:
            path.replace(path.with_suffix(".jsonl.1"))
        with path.open("ab") as handle:
            handle.write(json_lines(entries))

    def buffer(self, app: str, entry: dict[str, Any]) -> None:
        """A line to write with the next `flush()`: request lines come often, and the
        gateway should not open a file per request."""
        self._buffered[app].append(entry)

    def flush(self) -> None:
        buffered, self._buffered = self._buffered, defaultdict(list)
        for app, entries in buffered.items():
            self.write(app, entries)

    def system(self, app: str, endpoint: str, text: str, replica: str | None = None) -> None:
        """A line written by the platform itself about an endpoint."""
        self.write(
            app,
            [
                {
                    "ts": time.time(),
                    "endpoint": endpoint,
                    "replica": replica or "",
                    "stream": "ember",
                    "text": text,
                }
            ],
        )

    def has_lines(self, app: str) -> bool:
        return self._path(app).exists() or self._path(app).with_suffix(".jsonl.1").exists()

    def tail(self, app: str, lines: int, wanted: LogFilter = LogFilter()) -> list[dict[str, Any]]:
        """The last `lines` entries that `wanted` matches, oldest first, from the app's file
        and then its rotated one."""
        found: list[dict[str, Any]] = []
        for path in (self._path(app), self._path(app).with_suffix(".jsonl.1")):
            if len(found) >= lines:
                break
            if not path.exists():
                continue
            for raw in lines_backwards(path):
                try:
                    entry = json.loads(raw)
                except ValueError:
                    continue  # an empty or cut line
                stamp = float(entry.get("ts", 0))
                if wanted.since is not None and stamp < wanted.since - ORDER_SLACK_SECONDS:
                    return found[::-1]
                if wanted.matches(entry):
                    found.append(entry)
                    if len(found) >= lines:
                        break
        return found[::-1]

    def follow(self, app: str) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(FOLLOW_LINES)
        self._followers[app].add(queue)
        return queue

    def unfollow(self, app: str, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._followers[app].discard(queue)
        self._missed.pop(queue, None)
