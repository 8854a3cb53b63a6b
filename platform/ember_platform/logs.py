"""Replica and platform log lines, kept per app as JSON lines and streamed to followers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

MAX_LOG_BYTES = 64 * 1024 * 1024  # per app file before it is rotated once
log = logging.getLogger("ember.logs")


class LogSink:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._followers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = defaultdict(set)
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
            for entry in entries:
                queue.put_nowait(entry)

    def _append(self, app: str, entries: list[dict[str, Any]]) -> None:
        path = self._path(app)
        if path.exists() and path.stat().st_size > MAX_LOG_BYTES:
            path.replace(path.with_suffix(".jsonl.1"))
        with path.open("a") as handle:
            handle.write("".join(json.dumps(entry) + "\n" for entry in entries))

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

    def tail(self, app: str, endpoint: str | None, lines: int) -> list[dict[str, Any]]:
        path = self._path(app)
        if not path.exists():
            return []
        entries = []
        for raw in path.read_text().splitlines()[-lines * 4 :]:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if endpoint is None or entry.get("endpoint") == endpoint:
                entries.append(entry)
        return entries[-lines:]

    def follow(self, app: str) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._followers[app].add(queue)
        return queue

    def unfollow(self, app: str, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self._followers[app].discard(queue)
