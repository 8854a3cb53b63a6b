"""Endpoints that web pages call from a browser (CORS)."""

import ember


@ember.endpoint(snapshot=False, cors_origins=["https://app.example.com"])
def shout(text: str) -> str:
    return text.upper()


@ember.endpoint(snapshot=False, public=True, cors_origins=["*"])
def count(to: int = 3):
    yield from range(to)


@ember.endpoint(snapshot=False)
def closed(text: str) -> str:
    return text
