"""Batched endpoints: a function and a class method, each reporting its batch size."""

import ember


@ember.endpoint(concurrency=8, max_replicas=1)
@ember.batched(max_batch_size=8, wait_ms=100)
def double(x: list[int]) -> list[dict]:
    return [{"y": 2 * v, "batch": len(x)} for v in x]


@ember.endpoint(concurrency=4, max_replicas=1)
class Lengths:
    @ember.method
    @ember.batched(max_batch_size=4, wait_ms=100)
    async def measure(self, text: list[str], plus: list[int] = 0) -> list[dict]:  # type: ignore[assignment]
        return [{"n": len(t) + p, "batch": len(text)} for t, p in zip(text, plus, strict=True)]
