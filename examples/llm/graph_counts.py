"""How many graphs this process has made: CUDA graphs captured and graphs compiled, and
how many compiled graphs Inductor found in its cache or had to compile.

A replica restored from a snapshot should replay the CUDA graphs its snapshot captured,
never capture again: `stats` reports both counts and how many came after the warm-up,
and bench/gpu_coldstart.py checks that a restored replica's first request adds none.

The CUDA count wraps `torch.cuda.CUDAGraph.capture_begin` (the Python class every capture
goes through, torch.compile's CUDA graph trees included) once per process. The compiled
count is Dynamo's own `unique_graphs` counter; the cache's are Inductor's FX graph cache
hits and misses (a replica given a warm cache should only hit).
"""

from __future__ import annotations

from typing import Any

_captures = 0
_wrapped = False


def count_captures(torch: Any) -> None:
    """Count CUDA graph captures in this process from now on (once; later calls do
    nothing). On a machine without CUDA there is nothing to count."""
    global _wrapped
    if _wrapped or not torch.cuda.is_available():
        return
    graph_class = torch.cuda.graphs.CUDAGraph
    capture_begin = graph_class.capture_begin

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _captures
        _captures += 1
        return capture_begin(self, *args, **kwargs)

    graph_class.capture_begin = counted
    _wrapped = True


def graph_counts() -> dict[str, int]:
    """So far in this process: CUDA graphs captured, graphs compiled, compile-cache hits
    and misses."""
    from torch._dynamo.utils import counters

    return {
        "cuda_graph_captures": _captures,
        "compiled_graphs": int(counters["stats"]["unique_graphs"]),
        "compile_cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "compile_cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
    }
