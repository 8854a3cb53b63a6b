"""The tokens LLM endpoints read and wrote, online and in batches: taken from the `usage`
OpenAI-shaped answers carry (`prompt_tokens`, `completion_tokens`), counted in memory
per endpoint and minute, and written to the state store at each controller tick, so that
`ember usage` can say what a million tokens cost."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ember_platform.storage.records import TokenUsage
from ember_platform.storage.state_store import StateStore, StoreWriteError

log = logging.getLogger("ember.usage")

ONLINE = "online"
BATCH = "batch"


@dataclass
class Tokens:
    input: int = 0
    output: int = 0
    requests: int = 0


def answer_tokens(body: bytes | bytearray) -> tuple[int, int] | None:
    """(input, output) tokens of an answer or stream event carrying OpenAI's `usage`."""
    if body[:1] != b"{" or b'"usage"' not in body:
        return None  # most answers carry none: skip the parse
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return None
    if not isinstance(usage, dict):
        return None
    read, wrote = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if not (isinstance(read, int) and isinstance(wrote, int) and _count(read) and _count(wrote)):
        return None
    return read, wrote


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TokenLedger:
    """Counts not yet written, by (app, endpoint, traffic, minute)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str, str, int], Tokens] = {}

    def add(
        self, app: str, endpoint: str, traffic: str, tokens: tuple[int, int], now: float
    ) -> None:
        key = (app, endpoint, traffic, int(now // 60) * 60)
        counted = self._pending.get(key)
        if counted is None:
            counted = self._pending[key] = Tokens()
        counted.input += tokens[0]
        counted.output += tokens[1]
        counted.requests += 1

    def flush(self, store: StateStore) -> None:
        """Written to the store; kept for the next tick if it refuses them."""
        pending, self._pending = self._pending, {}
        for index, (key, tokens) in enumerate(pending.items()):
            try:
                store.add_token_usage(
                    TokenUsage(*key, tokens.input, tokens.output, tokens.requests)
                )
            except StoreWriteError as error:
                log.warning("token counts kept for the next tick: %s", error)
                for later, counted in list(pending.items())[index:]:
                    self._pending[later] = counted
                return
