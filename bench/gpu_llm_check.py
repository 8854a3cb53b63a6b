"""GPU check of the LLM example's engine: CUDA graphs captured by `warm()` replay right.

The engine of `examples/llm` compiles its batched decode step with `torch.compile`, and on
a CUDA model with `mode="reduce-overhead"`: `warm()` (run in `enter(snap=True)`) records a
CUDA graph per batch size and span, and every step after replays one. This script checks
that on an NVIDIA machine, with a SmolLM2-135M-shaped decoder (random weights: nothing to
download, no tokenizer), in one run of a few minutes:

1. eager and compiled engines decode the same prompts (8 at once, then 1), greedy; the
   first decoding step's logits must agree within rounding and give the same tokens
   (later tokens may part where two logits tie within rounding: their count is shown);
2. after `warm()`, decoding compiles nothing more (no new graphs);
3. tokens/s eager vs compiled at batch 1 and 8, and the warm-up's seconds.

    python3 bench/gpu_llm_check.py                 # on the GPU machine, from the repo root
    python3 bench/gpu_llm_check.py --device cpu --layers 2   # a dry run of the script

Exit status 0 when every check passes, 1 when one fails. Without CUDA (and no --device)
it prints "skipped: no CUDA device" and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm"
SMOLLM2 = {  # SmolLM2-135M's shape
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100_000.0,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
}


def build_model(torch: Any, layers: int, device: str) -> Any:
    from model import LlamaConfig, LlamaDecoder

    config = LlamaConfig(num_hidden_layers=layers, **SMOLLM2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaDecoder(config)
    # Default init gives nearly flat logits, where any rounding flips an argmax; a wider
    # embedding (it is also the output head) spreads them as a trained model's are.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model.eval().requires_grad_(False)


def decode(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[Any], float]:
    began = time.perf_counter()
    handles = [engine.submit(p, new_tokens) for p in prompts]
    for handle in handles:
        handle.result()
    return handles, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cuda (default when there is one) or cpu")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("skipped: no CUDA device")
        return 0
    sys.path.insert(0, str(EXAMPLE))
    from engine import Engine

    print(f"torch {torch.__version__} on {device}", end="")
    print(f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
    model = build_model(torch, args.layers, device)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, SMOLLM2["vocab_size"], (20 + 7 * i,), generator=generator).tolist()
        for i in range(8)
    ]
    max_len = max(map(len, prompts)) + args.new_tokens
    results: dict[str, dict[str, Any]] = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        with Engine(model, max_batch=8, max_len=max_len, compile=compiled, keep_logits=True) as e:
            warm = e.warm()
            graphs_after_warm = _graph_count(torch)
            decode(e, prompts[:1], 4)  # first use after the warm-up, outside the timing
            eight, eight_s = decode(e, prompts, args.new_tokens)
            one, one_s = decode(e, prompts[:1], args.new_tokens)
            results[name] = {
                "warm_s": warm,
                "new_graphs": _graph_count(torch) - graphs_after_warm,
                "tokens": [h.generated for h in eight],
                # The first decoding step's (the prefill before it runs eager either way).
                "step_logits": [h.logits[1] for h in eight],
                "batch8_tokens_per_s": 8 * args.new_tokens / eight_s,
                "batch1_tokens_per_s": args.new_tokens / one_s,
                "batch1_tokens": one[0].generated,
            }
        print(
            f"{name:>8}: warm-up {warm:6.1f} s; batch 8 "
            f"{results[name]['batch8_tokens_per_s']:7.1f} tokens/s; batch 1 "
            f"{results[name]['batch1_tokens_per_s']:6.1f} tokens/s"
        )
    return report(torch, results)


def _graph_count(torch: Any) -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def report(torch: Any, results: dict[str, dict[str, Any]]) -> int:
    eager, compiled = results["eager"], results["compiled"]
    diffs = [
        float((a - b).abs().max())
        for a, b in zip(eager["step_logits"], compiled["step_logits"], strict=True)
    ]
    spread = max(float(x.abs().max()) for x in eager["step_logits"])
    close = max(diffs) <= 1e-3 * spread + 1e-3
    same = sum(
        a == b
        for x, y in zip(eager["tokens"], compiled["tokens"], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    total = sum(map(len, eager["tokens"]))
    pairs = zip(eager["tokens"], compiled["tokens"], strict=True)
    first_steps_equal = all(x[:2] == y[:2] for x, y in pairs)
    checks = {
        f"first decoding step's logits agree (max diff {max(diffs):.2e}, logits up to "
        f"{spread:.1f})": close,
        f"tokens of the prefill and the first step equal; {same}/{total} tokens equal over "
        "the run": first_steps_equal,
        f"no graphs compiled after warm() ({compiled['new_graphs']} new)": compiled["new_graphs"]
        == 0,
    }
    for text, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}: {text}")
    print(
        f"compiled / eager: batch 8 "
        f"{compiled['batch8_tokens_per_s'] / eager['batch8_tokens_per_s']:.2f}x, batch 1 "
        f"{compiled['batch1_tokens_per_s'] / eager['batch1_tokens_per_s']:.2f}x"
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
