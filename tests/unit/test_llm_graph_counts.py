"""examples/llm/graph_counts.py: CUDA graph captures counted through the one Python method
every capture calls, and Dynamo's compiled graphs. A CPU machine has no CUDA graph, so
the capture method is stood in for by a recorder; the wrapping is what is tested."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from llm_example import example_module


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = example_module("graph_counts")
    monkeypatch.setattr(module, "_captures", 0)
    monkeypatch.setattr(module, "_wrapped", False)
    return module


def test_nothing_is_wrapped_without_cuda(counts: Any) -> None:
    original = torch.cuda.graphs.CUDAGraph.capture_begin
    counts.count_captures(torch)
    assert torch.cuda.graphs.CUDAGraph.capture_begin is original
    assert counts.graph_counts()["cuda_graph_captures"] == 0


def test_each_capture_is_counted_once_and_still_runs(
    counts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    began: list[tuple[Any, ...]] = []

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> str:
        began.append((self, args, kwargs))
        return "captured"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.graphs.CUDAGraph, "capture_begin", capture_begin)
    counts.count_captures(torch)
    counts.count_captures(torch)  # a second call must not wrap the wrapper
    wrapped = torch.cuda.graphs.CUDAGraph.capture_begin
    assert wrapped("graph", pool=(1, 2), capture_error_mode="thread_local") == "captured"
    wrapped("graph")
    assert began == [
        ("graph", (), {"pool": (1, 2), "capture_error_mode": "thread_local"}),
        ("graph", (), {}),
    ]
    assert counts.graph_counts()["cuda_graph_captures"] == 2


def test_compiled_graphs_come_from_dynamo(counts: Any) -> None:
    from torch._dynamo.utils import counters

    before = counts.graph_counts()["compiled_graphs"]
    counters["stats"]["unique_graphs"] += 3
    try:
        assert counts.graph_counts()["compiled_graphs"] == before + 3
    finally:
        counters["stats"]["unique_graphs"] -= 3


def test_compile_cache_hits_and_misses_come_from_inductor(counts: Any) -> None:
    from torch._dynamo.utils import counters

    before = counts.graph_counts()
    counters["inductor"]["fxgraph_cache_hit"] += 2
    counters["inductor"]["fxgraph_cache_miss"] += 1
    try:
        after = counts.graph_counts()
        assert after["compile_cache_hits"] == before["compile_cache_hits"] + 2
        assert after["compile_cache_misses"] == before["compile_cache_misses"] + 1
    finally:
        counters["inductor"]["fxgraph_cache_hit"] -= 2
        counters["inductor"]["fxgraph_cache_miss"] -= 1
