"""Output tokens/s of concurrent requests through the batching engine vs one at a time.

    python examples/llm/bench_batching.py --dir ~/.cache/ember/llm/smollm2 --requests 8

Converts the model into `--dir` first if it is not there. No stop ids, so every request
generates exactly `--new-tokens` and both runs do the same work. `measure` is the function
a benchmark suite calls with a loaded model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Hi",
    "Explain gravity to a child in two sentences, please, with an example.",
    "2+2?",
    "Name three colours.",
    "Translate 'good morning' into Spanish.",
    "What does a KV cache store in a transformer decoder?",
]


def measure(
    model: Any, prompts: list[list[int]], new_tokens: int = 32, max_batch: int = 8
) -> dict[str, float]:
    """Tokens/s of `prompts` one at a time with `model.generate`, then all submitted
    together to an Engine; also whether both gave the same tokens."""
    from engine import Engine

    for _ in model.generate(prompts[0], 2):  # warm the kernels before timing either
        pass
    began = time.perf_counter()
    alone = [list(model.generate(p, new_tokens)) for p in prompts]
    sequential_s = time.perf_counter() - began

    with Engine(model, max_batch=max_batch, max_len=max(map(len, prompts)) + new_tokens) as eng:
        eng.generate_many(prompts[:1], 2)  # warm the batched path too
        began = time.perf_counter()
        batched = eng.generate_many(prompts, new_tokens)
        batched_s = time.perf_counter() - began

    tokens = sum(map(len, alone))
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "sequential_tokens_per_s": tokens / sequential_s,
        "batched_tokens_per_s": sum(map(len, batched)) / batched_s,
        "speedup": sequential_s / batched_s,
        "identical": float(batched == alone),
    }


def main() -> None:
    import sys

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))  # model.py, engine.py, convert.py are siblings
    from convert import convert
    from model import chat_prompt_ids, load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache/ember/llm/smollm2")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    convert(args.dir)
    model = load_model(args.dir)
    questions = (QUESTIONS * (args.requests // len(QUESTIONS) + 1))[: args.requests]
    prompts = [chat_prompt_ids(args.dir, [{"role": "user", "content": q}]) for q in questions]
    result = measure(model, prompts, args.new_tokens, max_batch=args.requests)
    print(
        f"{result['requests']} requests x {args.new_tokens} new tokens: "
        f"one at a time {result['sequential_tokens_per_s']:.1f} tokens/s, "
        f"batched {result['batched_tokens_per_s']:.1f} tokens/s "
        f"({result['speedup']:.2f}x), identical tokens: {bool(result['identical'])}"
    )


if __name__ == "__main__":
    main()
