"""Affinity keys: `X-Ember-Affinity: KEY` (`call(_affinity="chat-42")`).

Calls that carry the same key go to the same replica while it has room, so that what it
keeps between calls (a chat's KV cache, a loaded model, a session's state) is reused
instead of rebuilt on another replica. The key is any text the caller chooses: a
session, a user, a prompt's prefix, a model's name."""

from __future__ import annotations

from ember.cancellation import current_input_flag
from ember.errors import InvalidError

AFFINITY_HEADER = "X-Ember-Affinity"
MAX_AFFINITY_KEY = 256  # bytes: enough for a hash or a name, small in every frame


def check_affinity_key(key: str) -> str:
    """The key itself, or InvalidError saying what a key may be."""
    encoded = key.encode("utf-8")
    if not encoded or len(encoded) > MAX_AFFINITY_KEY:
        raise InvalidError(f"an affinity key is 1 to {MAX_AFFINITY_KEY} bytes (got {len(encoded)})")
    if not key.isprintable() or not key.isascii():
        raise InvalidError(
            "an affinity key is printable ASCII (hash other text first, e.g. with hashlib)"
        )
    if key != key.strip(" "):  # HTTP drops spaces around a header's value
        raise InvalidError("an affinity key neither starts nor ends with a space")
    return key


def affinity_headers(key: str | None) -> dict[str, str]:
    """The header that carries `key` (checked here, before any request is sent)."""
    if key is None:
        return {}
    return {AFFINITY_HEADER: check_affinity_key(key)}


def current_affinity_key() -> str | None:
    """In a replica, the affinity key of the call this code runs for (the model a
    multiplexed endpoint should use, the session whose state to reuse); None when the
    call has none, and outside a call."""
    return getattr(current_input_flag(), "affinity", None)
