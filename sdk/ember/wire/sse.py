"""Server-sent events: how generator output travels to callers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


def encode_event(data: str, event: str | None = None) -> bytes:
    lines = [f"event: {event}"] if event else []
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


@dataclass(frozen=True)
class Event:
    event: str  # "message" unless the server named it ("error", "end")
    data: str


class EventParser:
    """A text/event-stream read line by line (without trailing newlines): `feed` returns
    the event a blank line completes, `finish` the one the stream ended inside."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        if not line:
            done = Event(self._event, "\n".join(self._data)) if self._data else None
            self._event, self._data = "message", []
            return done
        if not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                self._event = value
            elif field == "data":
                self._data.append(value)
        return None

    def finish(self) -> Event | None:
        return self.feed("")


def parse_events(lines: Iterable[str]) -> Iterator[Event]:
    """Parse a text/event-stream given line by line (without trailing newlines)."""
    parser = EventParser()
    for line in lines:
        event = parser.feed(line)
        if event is not None:
            yield event
    last = parser.finish()
    if last is not None:
        yield last
