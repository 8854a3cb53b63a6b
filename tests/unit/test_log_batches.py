"""The agent cuts what replicas print into channel messages of bounded size."""

from __future__ import annotations

from typing import Any

from ember_worker.agent.log_shipping import log_batches


def entries(*sizes: int) -> list[dict[str, Any]]:
    return [{"text": "x" * size, "n": n} for n, size in enumerate(sizes)]


def test_batches_keep_order_and_stay_under_the_limit() -> None:
    lines = entries(*([1000] * 50))
    batches = list(log_batches(lines, 10_000))
    assert [e["n"] for batch in batches for e in batch] == list(range(50))
    assert len(batches) > 1
    assert all(sum(len(e["text"]) + 200 for e in batch) <= 10_000 for batch in batches)


def test_a_line_over_the_limit_goes_alone_and_nothing_is_empty() -> None:
    batches = list(log_batches(entries(10, 50_000, 10), 10_000))
    assert [[e["n"] for e in batch] for batch in batches] == [[0], [1], [2]]
    assert list(log_batches([], 10_000)) == []
