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


def parse_events(lines: Iterable[str]) -> Iterator[Event]:
    """Parse a text/event-stream given line by line (without trailing newlines)."""
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield Event(event, "\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
    if data:
        yield Event(event, "\n".join(data))
