"""Idempotency keys: `Idempotency-Key: KEY` (`spawn(_idempotency_key="job-17")`).

A spawn retried with the same key (and arguments) gets the call the first one started
instead of a second run. The key travels as an HTTP header, so it is checked here, before
any request is sent, with a message that says what a key may be."""

from __future__ import annotations

from ember.errors import InvalidError

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY = 255  # characters; the gateway refuses longer ones too


def check_idempotency_key(key: str) -> str:
    """The key itself, or InvalidError naming the rule it breaks."""
    if not isinstance(key, str):
        raise InvalidError(f"an idempotency key is a string, not {type(key).__name__}")
    if not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise InvalidError(
            f"an idempotency key is 1 to {MAX_IDEMPOTENCY_KEY} characters (got {len(key)})"
        )
    if not key.isascii() or not key.isprintable():
        raise InvalidError(
            "an idempotency key is printable ASCII (hash other text first, e.g. with hashlib)"
        )
    # HTTP drops spaces around a header's value: " job" would arrive as "job".
    if key != key.strip(" "):
        raise InvalidError("an idempotency key neither starts nor ends with a space")
    return key
