"""The int8-weight decoder (quantize.py) against fp32: greedy agreement, perplexity, speed.

    python examples/llm/evaluate_int8.py --dir ~/.cache/ember/llm/smollm2

Converts the model into `--dir` first if it is not there. Three measures on the text below
(shipped in this file, so the numbers are reproducible offline):
1. greedy agreement: each prompt decoded for `--agree-tokens` tokens by both models; the
   share of positions before the first divergence, and how many sequences match in full;
2. perplexity of each model on the paragraphs (teacher-forced next-token NLL);
3. decode tokens/s at batch 1 for `--new-tokens` tokens (best of 3).
`evaluate` is the function a benchmark suite calls with two loaded models.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

PARAGRAPHS = [
    "The river starts high in the hills, where snow melts in the spring and runs down "
    "between the rocks. By the time it reaches the valley it is wide and slow, and the "
    "farmers along its banks use its water for their fields of wheat and barley.",
    "Every Saturday morning the market fills the old square. People come early to buy "
    "bread, cheese and fresh vegetables, and the baker usually sells out of his small "
    "round loaves before ten o'clock. In the afternoon the square is quiet again.",
    "A good cup of tea needs only a few things: fresh water, a warm pot and a little "
    "patience. Pour the water just after it boils, let the leaves steep for three or four "
    "minutes, and then add milk or lemon if you like.",
    "The library on the corner has been open for more than a hundred years. Its reading "
    "room has tall windows and long wooden tables, and on rainy days it is full of "
    "students, retired teachers and children looking for picture books.",
    "Learning to ride a bicycle takes time. Most children fall a few times before they "
    "find their balance, but once they do, they rarely forget. Adults who learn later say "
    "the hardest part is trusting that the bicycle will stay up when it moves.",
    "The train left the station at half past seven. Outside the window the city gave way "
    "to small towns, then to open fields and forests, and by noon the passengers could see "
    "the sea shining in the distance.",
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain gravity to a child in two sentences.",
    "Give me three tips for sleeping well.",
    "What is the difference between a lake and a pond?",
    "Describe a cat to someone who has never seen one.",
    "How do I boil an egg?",
    "Why is the sky blue?",
]


def greedy_agreement(
    reference: Any, other: Any, prompts: list[list[int]], new_tokens: int = 32
) -> dict[str, float]:
    """Both models decode each prompt greedily (no stop ids, so exactly `new_tokens`); the
    share of positions before the first divergence and the count of identical sequences."""
    agreed = full = 0
    for prompt in prompts:
        mine = list(reference.generate(prompt, new_tokens))
        theirs = list(other.generate(prompt, new_tokens))
        prefix = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), new_tokens
        )
        agreed += prefix
        full += prefix == new_tokens
    return {
        "prompts": len(prompts),
        "agreement": agreed / (len(prompts) * new_tokens),
        "full_matches": full,
    }


def perplexity(model: Any, texts: list[list[int]]) -> float:
    """exp of the mean next-token NLL over every position of every text (teacher-forced)."""
    import torch
    from torch.nn import functional

    nll, count = 0.0, 0
    with torch.inference_mode():
        for ids in texts:
            tokens = torch.tensor([ids])
            states = model.hidden_states(tokens, model.new_cache(len(ids)))
            logits = model.logits(states[0, :-1]).float()
            nll += float(functional.cross_entropy(logits, tokens[0, 1:], reduction="sum"))
            count += len(ids) - 1
    return math.exp(nll / count)


def decode_tokens_per_s(model: Any, prompt: list[int], new_tokens: int = 64) -> float:
    """Batch-1 greedy decoding speed, prefill included, best of 3 after a warm-up."""
    for _ in model.generate(prompt, 2):
        pass
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        out = list(model.generate(prompt, new_tokens))
        best = min(best, time.perf_counter() - began)
    return len(out) / best


def evaluate(
    fp32: Any,
    int8: Any,
    prompts: list[list[int]],
    texts: list[list[int]],
    *,
    agree_tokens: int = 32,
    new_tokens: int = 64,
) -> dict[str, float]:
    """Every measure of the module docstring, as one flat dict of numbers."""
    result: dict[str, float] = dict(greedy_agreement(fp32, int8, prompts, agree_tokens))
    result["ppl_fp32"] = perplexity(fp32, texts)
    result["ppl_int8"] = perplexity(int8, texts)
    result["ppl_ratio"] = result["ppl_int8"] / result["ppl_fp32"]
    result["tokens_per_s_fp32"] = decode_tokens_per_s(fp32, prompts[0], new_tokens)
    result["tokens_per_s_int8"] = decode_tokens_per_s(int8, prompts[0], new_tokens)
    result["speedup"] = result["tokens_per_s_int8"] / result["tokens_per_s_fp32"]
    return result


def main() -> None:
    import sys

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))  # model.py, quantize.py, convert.py are siblings
    from convert import convert
    from model import chat_prompt_ids, load_model, tokenizer
    from quantize import projection_bytes, quantize_int8

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache/ember/llm/smollm2")
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS))
    parser.add_argument("--agree-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    convert(args.dir)
    fp32 = load_model(args.dir)
    int8 = quantize_int8(load_model(args.dir))
    prompts = [
        chat_prompt_ids(args.dir, [{"role": "user", "content": q}])
        for q in QUESTIONS[: args.prompts]
    ]
    texts = [tokenizer(args.dir).encode(p).ids for p in PARAGRAPHS]
    r = evaluate(
        fp32, int8, prompts, texts, agree_tokens=args.agree_tokens, new_tokens=args.new_tokens
    )
    mib = (projection_bytes(fp32) / 2**20, projection_bytes(int8) / 2**20)
    print(
        f"greedy agreement over {r['prompts']} prompts x {args.agree_tokens} tokens: "
        f"{r['agreement']:.1%} of positions before the first divergence, "
        f"{r['full_matches']}/{r['prompts']} sequences identical"
    )
    print(f"{'':<6} {'perplexity':>10} {'tokens/s':>9} {'proj MiB':>9}")
    print(f"{'fp32':<6} {r['ppl_fp32']:>10.3f} {r['tokens_per_s_fp32']:>9.1f} {mib[0]:>9.1f}")
    print(f"{'int8':<6} {r['ppl_int8']:>10.3f} {r['tokens_per_s_int8']:>9.1f} {mib[1]:>9.1f}")
    print(f"int8/fp32: perplexity x{r['ppl_ratio']:.3f}, speed x{r['speedup']:.2f}")


if __name__ == "__main__":
    main()
