"""Deterministic streams for `ember bench`: known waits, known token counts."""

import time

import ember


@ember.endpoint(concurrency=4)
def ticks(prompt: str = "", max_tokens: int = 5, first_delay: float = 0.2, gap: float = 0.05):
    """Shaped like an LLM endpoint: `max_tokens` events, the first after `first_delay`."""
    time.sleep(first_delay)
    for n in range(max_tokens):
        if n:
            time.sleep(gap)
        yield {"token_id": n}


@ember.endpoint(concurrency=4)
def token_batches(count: int = 3, per_event: int = 4):
    """Each event carries several token ids, as a server that batches its output may."""
    for n in range(count):
        yield {"token_ids": list(range(n * per_event, (n + 1) * per_event))}


@ember.endpoint(concurrency=4)
class Chat:
    """OpenAI-shaped: served at v1/chat/completions, streaming only when `stream` is true."""

    @ember.method(path="v1/chat/completions", stream_flag="stream")
    def completions(self, messages: list, max_tokens: int = 3, stream: bool = False):
        if not stream:
            return {"choices": [{"message": {"content": "x" * max_tokens}}]}
        return ({"token_ids": [n]} for n in range(max_tokens))
