"""Speculative decoding by prompt lookup, for one sequence, greedy and so lossless.

Output that copies its input (rewrites, quotes, lists repeated) continues an n-gram already in
the context. Each step looks up the last few tokens earlier in (prompt + generated), proposes
what followed them there as a draft, and checks the whole draft with ONE forward pass through
the KV cache: the longest prefix matching the model's own greedy choices is kept, plus the
model's next token after it. The tokens are exactly those of `model.generate`; only the number
of forward passes changes.

    stats = LookupStats()
    for token in generate_prompt_lookup(model, ids, 64, {eos}, stats=stats): ...
    print(stats.accepted / stats.proposed)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LookupStats:
    """Counts over one `generate_prompt_lookup` run."""

    proposed: int = 0  # draft tokens sent to the model
    accepted: int = 0  # draft tokens that matched its greedy choice and were yielded
    forward_passes: int = 0  # prefill included
    tokens: int = 0  # tokens yielded

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


# The shortest n-gram a draft may follow (unless `ngram` itself is shorter). What follows a
# single repeated token is rarely what the model says next, and a step that verifies a
# draft costs 1.6-1.8x a plain one on CPU: on bench/llm.py's rewrites, stopping at 2-grams
# decoded 4-10 % faster than going down to 1-grams.
MIN_NGRAM = 2


def find_draft(
    history: list[int], ngram: int, draft_len: int, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to `draft_len` tokens that followed the most recent earlier occurrence of the last
    `ngram` tokens of `history`, trying shorter n-grams down to `min_ngram` (or `ngram`,
    when that is shorter); [] when none occurs."""
    if draft_len <= 0:
        return []
    end = len(history)
    for n in range(min(ngram, end - 1), min(min_ngram, ngram) - 1, -1):
        tail = history[end - n :]
        # Occurrences ending before the last token, newest first: recent text is likelier
        # to be what the output is copying right now.
        for start in range(end - n - 1, -1, -1):
            if history[start : start + n] == tail:
                return history[start + n : start + n + draft_len]
    return []


def forward_all(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits after every position of `ids` (1, length) -> (length, vocab), appending them to
    `cache`: the model's `forward` keeps only the last, and verifying a draft needs each."""
    return model.logits(model.hidden_states(ids, cache)[0])


@torch.inference_mode()
def generate_prompt_lookup(
    model: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    *,
    ngram: int = 3,
    draft_len: int = 8,
    stats: LookupStats | None = None,
) -> Iterator[int]:
    """The greedy tokens of `model.generate(prompt_ids, max_new_tokens, stop_ids)`, found with
    fewer forward passes when drafts from the context are accepted; fills `stats` if given."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if ngram < 1:
        raise ValueError("ngram must be at least 1")
    if max_new_tokens <= 0:
        return
    stats = stats if stats is not None else LookupStats()
    stops = set(stop_ids)
    device = model.model.embed_tokens.weight.device
    # The same capacity as `generate`: a draft is cut to the tokens still wanted, so a
    # verification pass never writes past prompt + max_new_tokens.
    cache = model.new_cache(
        min(len(prompt_ids) + max_new_tokens, model.config.max_position_embeddings)
    )
    history = list(prompt_ids)
    token = int(model(torch.tensor([prompt_ids], dtype=torch.long, device=device), cache).argmax())
    stats.forward_passes += 1
    produced = 1
    stats.tokens += 1
    yield token
    history.append(token)
    if token in stops:
        return
    while produced < max_new_tokens:
        # The pass yields the accepted drafts plus one token of its own, so a draft longer
        # than the tokens still wanted, less one, would be wasted work.
        draft = find_draft(history, ngram, min(draft_len, max_new_tokens - produced - 1))
        filled = cache.length  # `token` (the last yielded) is not in the cache yet
        feed = torch.tensor([[token, *draft]], dtype=torch.long, device=device)
        choices = forward_all(model, feed, cache).argmax(dim=-1).tolist()
        stats.forward_passes += 1
        stats.proposed += len(draft)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == choices[accepted]:
            accepted += 1
        # Keys/values of rejected drafts stay in the buffer but past `length`, so they are
        # never attended to and the next pass overwrites them.
        cache.length = filled + 1 + accepted
        for index, token in enumerate([*draft[:accepted], choices[accepted]]):
            # Counted as yielded: drafts after an accepted stop id are not output.
            stats.accepted += int(index < accepted)
            produced += 1
            stats.tokens += 1
            yield token
            history.append(token)
            if token in stops:
                return
