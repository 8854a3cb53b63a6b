"""Output tokens/s of one request decoded plainly vs by prompt lookup, on a task whose answer
copies its input (fixing the spelling of a paragraph), with the draft acceptance rate.

    python examples/llm/bench_lookup.py --dir ~/.cache/ember/llm/smollm2 --new-tokens 64

Converts the model into `--dir` first if it is not there. No stop ids, so both runs generate
exactly `--new-tokens`. `measure` is the function a benchmark suite calls with a loaded model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

GROUNDED = (
    "Rewrite this text, fixing the spelling: The quick brown fox jumpd over the lazy dog. "
    "Every morning the farmer walkd to the feild to feed his cows and check on the shep. "
    "In the afternon he repaired the fence and watered the vegetable garden before diner."
)


def measure(
    model: Any, prompt: list[int], new_tokens: int = 64, *, ngram: int = 3, draft_len: int = 8
) -> dict[str, float]:
    """Tokens/s of `prompt` with `model.generate` then with prompt lookup (best of 3 runs
    each), the acceptance rate, forward passes, and whether both gave the same tokens."""
    from prompt_lookup import LookupStats, generate_prompt_lookup

    for _ in model.generate(prompt, 2):  # warm the kernels before timing either
        pass

    plain_s = lookup_s = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        plain = list(model.generate(prompt, new_tokens))
        plain_s = min(plain_s, time.perf_counter() - began)
        stats = LookupStats()
        began = time.perf_counter()
        looked = list(
            generate_prompt_lookup(
                model, prompt, new_tokens, ngram=ngram, draft_len=draft_len, stats=stats
            )
        )
        lookup_s = min(lookup_s, time.perf_counter() - began)
    return {
        "output_tokens": len(plain),
        "plain_tokens_per_s": len(plain) / plain_s,
        "lookup_tokens_per_s": len(looked) / lookup_s,
        "speedup": plain_s / lookup_s,
        "acceptance_rate": stats.acceptance_rate,
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "forward_passes": stats.forward_passes,
        "identical": float(plain == looked),
    }


def main() -> None:
    import sys

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))  # model.py, prompt_lookup.py, convert.py are siblings
    import torch
    from convert import convert
    from model import chat_prompt_ids, load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache/ember/llm/smollm2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--draft-len", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    convert(args.dir)
    model = load_model(args.dir).to(torch.device(args.device))
    prompt = chat_prompt_ids(args.dir, [{"role": "user", "content": GROUNDED}])
    result = measure(model, prompt, args.new_tokens, ngram=args.ngram, draft_len=args.draft_len)
    print(
        f"1 request x {args.new_tokens} new tokens on {args.device}: "
        f"plain {result['plain_tokens_per_s']:.1f} tokens/s, "
        f"prompt lookup {result['lookup_tokens_per_s']:.1f} tokens/s "
        f"({result['speedup']:.2f}x); acceptance {result['acceptance_rate']:.0%} "
        f"({result['accepted']}/{result['proposed']} drafted tokens) in "
        f"{result['forward_passes']} forward passes; identical tokens: "
        f"{bool(result['identical'])}"
    )


if __name__ == "__main__":
    main()
