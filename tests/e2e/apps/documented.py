"""Endpoints whose OpenAPI documents the tests read (test_openapi.py)."""

from collections.abc import Iterator
from typing import Literal

import ember


@ember.endpoint(scaledown_window=30)
def translate(text: str, target: Literal["fr", "de"] = "fr", times: int = 1) -> dict[str, str]:
    """Translate a text.

    Not really: it tags the text with the language, `times` times."""
    return {"text": f"[{target}] {text}" * times}


@ember.endpoint(public=True)
def upload(data: bytes, note: str = "") -> dict:
    """Measure an uploaded file."""
    return {"size": len(data), "note": note}


@ember.endpoint()
class Tokens:
    @ember.method
    def count(self, words: list[str], sizes: dict[str, float] | None = None) -> int:
        return len(words)

    @ember.method
    def stream(self, n: int) -> Iterator[dict[str, int]]:
        """Count up to n, one event each."""
        for i in range(n):
            yield {"i": i}

    @ember.method(path="v1/thumb")
    def thumbnail(self, size: int = 64) -> ember.File:
        return ember.File(bytes(size), media_type="image/png")
