"""Continuous batching for the decoder of `model.py`: many greedy generations, one forward
pass per step for all of them.

A preallocated KV cache holds `max_batch` sequences, one slot each
(`[layers, max_batch, kv_heads, max_len, head_dim]` with a filled length per slot). A
background thread loops: requests waiting for a slot join (their prompt is prefilled alone,
through the model's own single-sequence forward, and copied into the slot), then every
running sequence decodes one token in a single batched pass, attention masked to each
slot's own positions; a sequence leaves after a stop id or `max_new_tokens`, freeing its
slot for the next step.

Prefix caching: after a prefill the prompt's keys and values are kept in blocks of
`PREFIX_BLOCK` tokens (`PrefixStore`, LRU within `prefix_cache_bytes`); a later prompt that
starts with the same blocks (a system prompt, chat history) copies them in and prefills only
the rest, at least its last token, whose logits give the first new token.

    engine = Engine(model, max_batch=8)
    handle = engine.submit(prompt_ids, max_new_tokens=32, stop_ids={eos})
    for token in handle.tokens(): ...
    outputs = engine.generate_many([prompt_a, prompt_b], max_new_tokens=32)
    engine.close()

`Engine(model, compile=True)` runs each layer of the batched step through `torch.compile`
(`decode_layer`: one graph serves all thirty layers; batch size and span are dynamic, so a
batch of 1 and any other batch are the only two graphs). Call `engine.warm()` before a
snapshot (`enter(snap=True)`) so compiling happens there, not in a replica's first
requests. Prefill stays eager: a prompt runs once and its length varies freely. On a CUDA
model the compiled step also replays CUDA graphs (`mode="reduce-overhead"`), spans rounded
up to `CUDA_SPAN_ROUND`, and `warm()` records every (batch, span) shape. On a 2-core CPU
compiling SmolLM2-135M took 8 to 22 s and decoded within a few per cent of eager (the
step is bound by reading the weights), so the option is off by default.

Decoding is greedy, so the tokens equal `model.generate`'s one request at a time, up to
rounding: a batched matmul may sum in another order than a one-row one, which moves logits
in their last bits and could flip an argmax between two (near-)equal logits.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from torch.nn import functional

if TYPE_CHECKING:
    from model import Attention, DecoderLayer, LlamaDecoder


PREFIX_BLOCK = 16  # tokens a prefix-cache block holds
PREFIX_CACHE_BYTES = 256 * 2**20
CUDA_SPAN_ROUND = 128  # with CUDA graphs, spans round up to this: one graph per 128 positions


class EngineClosed(RuntimeError):
    pass


class _Job:
    """A function for the engine thread to run; `wait` returns once it has, or raises
    what it raised."""

    def __init__(self, function: Callable[[], None]) -> None:
        self._function = function
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._function()
        except Exception as error:
            self._error = error
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class PrefixStats(TypedDict):
    prompt_tokens: int  # every prompt's tokens, seen at its prefill
    reused_tokens: int  # of those, taken from the prefix store instead of prefilled
    reuse_rate: float


class PrefixStore:
    """Keys and values of prompt prefixes in blocks of `block` tokens, least recently used
    evicted past `capacity_bytes`.

    A block's key is a digest chained over every token up to its end, so one key stands for
    the whole prefix: equal keys mean equal prefixes (up to a 128-bit hash collision), and
    a prompt's blocks are found one after another from its start.
    """

    def __init__(self, capacity_bytes: int, block: int = PREFIX_BLOCK) -> None:
        self.capacity_bytes = capacity_bytes
        self.block = block
        self.bytes = 0
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def keys_of(self, ids: Sequence[int], blocks: int) -> list[bytes]:
        """Keys of the first `blocks` full blocks of `ids`."""
        out: list[bytes] = []
        digest = b""
        for start in range(0, blocks * self.block, self.block):
            chunk = ids[start : start + self.block]
            data = digest + b"".join(i.to_bytes(4, "little") for i in chunk)
            digest = hashlib.blake2b(data, digest_size=16).digest()
            out.append(digest)
        return out

    def lookup(self, ids: Sequence[int], limit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The longest run of stored blocks that starts `ids`, within `limit` tokens; each
        (keys, values) is (layers, kv_heads, block, head_dim)."""
        found: list[bytes] = []
        for key in self.keys_of(ids, min(limit, len(ids)) // self.block):
            if key not in self._blocks:
                break
            found.append(key)
        # Most recent last, parents after children: eviction takes the tail of a prefix
        # first, never a block whose descendants stay (they could no longer be reached).
        for key in reversed(found):
            self._blocks.move_to_end(key)
        return [self._blocks[key] for key in found]

    def store(self, ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the full blocks of `ids`, whose keys and values are (layers, kv_heads,
        len(ids), head_dim); blocks already stored are only marked used."""
        blocks = len(ids) // self.block
        per_block = 2 * keys[:, :, : self.block].numel() * keys.element_size()
        if blocks == 0 or per_block > self.capacity_bytes:
            return
        # Parents inserted or touched last, as in `lookup`.
        for index, key in reversed(list(enumerate(self.keys_of(ids, blocks)))):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            span = slice(index * self.block, (index + 1) * self.block)
            # Cloned: a view would keep the whole prefill cache alive.
            self._blocks[key] = (keys[:, :, span].clone(), values[:, :, span].clone())
            self.bytes += per_block
        while self.bytes > self.capacity_bytes:
            _, (k, v) = self._blocks.popitem(last=False)
            self.bytes -= (k.numel() + v.numel()) * k.element_size()


class RequestHandle:
    """One submitted generation; its tokens arrive through `tokens()` as they are decoded."""

    def __init__(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.generated: list[int] = []  # written by the engine thread only
        self.logits: list[torch.Tensor] = []  # each step's logits, when the engine keeps them
        self._events: queue.Queue[int | BaseException | None] = queue.Queue()
        self._cancelled = threading.Event()

    def tokens(self) -> Iterator[int]:
        """Generated token ids as they come, ending after the last; iterate once."""
        while True:
            item = self._events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> list[int]:
        return list(self.tokens())

    def cancel(self) -> None:
        """Stop generating (a caller that went away); the slot frees at the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _emit(self, token: int) -> bool:
        """Hand out `token`; whether the request is finished."""
        self.generated.append(token)
        self._events.put(token)
        done = token in self.stop_ids or len(self.generated) >= self.max_new_tokens
        if done:
            self._events.put(None)
        return done

    def _fail(self, error: BaseException) -> None:
        self._events.put(error)


class Engine:
    def __init__(
        self,
        model: LlamaDecoder,
        max_batch: int = 8,
        max_len: int = 1024,
        keep_logits: bool = False,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        compile: bool = False,
    ) -> None:
        config = model.config
        if not 1 <= max_len <= config.max_position_embeddings:
            raise ValueError(f"max_len must be 1 to {config.max_position_embeddings}")
        self.model = model
        self.max_batch = max_batch
        self.max_len = max_len
        self.keep_logits = keep_logits  # for tests that compare logits, not only argmaxes
        # Touched by the engine thread only; None when prefix caching is off.
        self.prefix = PrefixStore(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._prompt_tokens = 0
        self._reused_tokens = 0
        weight = model.model.embed_tokens.weight
        shape = (config.num_hidden_layers, max_batch, config.num_key_value_heads, max_len)
        # Empty, so memory is only touched as positions get used (8 slots x 2048 positions
        # are ~750 MB in fp32); see `_clean` for the garbage that leaves.
        self.keys = torch.empty(*shape, config.head_dim, dtype=weight.dtype, device=weight.device)
        self.values = torch.empty_like(self.keys)
        self.lengths = [0] * max_batch  # positions filled in each slot
        # Positions of each slot ever written or zeroed. A step reads every slot up to the
        # longest one; the padding is masked, but NaN in never-written memory would still
        # reach the output (0 attention weight x NaN value), so it is zeroed first.
        self._clean = [0] * max_batch
        self._running: dict[int, RequestHandle] = {}  # slot -> request; engine thread only
        self._free = list(range(max_batch - 1, -1, -1))  # pop() takes the lowest slot
        self._pending: deque[RequestHandle] = deque()
        # Each layer's cache, the same tensors every step (a CUDA graph keeps their address).
        self._layer_keys = list(self.keys.unbind(0))
        self._layer_values = list(self.values.unbind(0))
        self._compiled, self._span_round = self._compile() if compile else (None, 1)
        self._jobs: deque[_Job] = deque()  # run by the engine thread while no sequence runs
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    # -- callers' side ------------------------------------------------------------------

    def submit(
        self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
    ) -> RequestHandle:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if len(prompt_ids) + max_new_tokens > self.max_len:
            raise ValueError(
                f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the "
                f"engine's {self.max_len} positions a sequence"
            )
        handle = RequestHandle(list(prompt_ids), max_new_tokens, frozenset(stop_ids))
        with self._wake:
            if self._closing:
                raise EngineClosed("the engine is closed")
            self._pending.append(handle)
            self._wake.notify()
        return handle

    def generate_many(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Iterable[int] = ()
    ) -> list[list[int]]:
        """Every prompt's tokens, all submitted at once (they share steps)."""
        stops = frozenset(stop_ids)
        handles = [self.submit(prompt, max_new_tokens, stops) for prompt in prompts]
        return [handle.result() for handle in handles]

    def prefix_stats(self) -> PrefixStats:
        """Prompt tokens prefilled so far and how many of them came from the prefix store."""
        seen, reused = self._prompt_tokens, self._reused_tokens
        return {
            "prompt_tokens": seen,
            "reused_tokens": reused,
            "reuse_rate": reused / seen if seen else 0.0,
        }

    def warm(
        self, batch_sizes: Sequence[int] | None = None, spans: Sequence[int] | None = None
    ) -> float:
        """Run a batched step of every size in `batch_sizes` at every span in `spans`
        (positions read, the longest row's with its new token), so compiling (and CUDA graph
        capture) happens now, before a snapshot, not in a request; the seconds it took.
        Waits for running sequences to finish, runs on the engine thread (CUDA graphs are
        recorded per thread), and leaves every slot as it was: free, length 0.

        Defaults: on CPU, batches 1, 2 and `max_batch` at two spans; dynamic shapes make
        those two graphs (a batch of 1, and any other) serve every batch and span. With CUDA
        graphs each (batch, span) shape is a graph of its own: every batch size and every
        `CUDA_SPAN_ROUND`-rounded span up to `max_len`."""
        cuda = self._span_round > 1
        if batch_sizes is None:
            batch_sizes = range(1, self.max_batch + 1) if cuda else {1, 2, self.max_batch}
        if spans is None:
            rounds = range(self._span_round, self.max_len + self._span_round, self._span_round)
            spans = [min(n, self.max_len) for n in rounds] if cuda else (5, 40)
            spans = [n for n in spans if n <= self.max_len] or [self.max_len]
        if any(not 1 <= size <= self.max_batch for size in batch_sizes):
            raise ValueError(f"batch sizes must be 1 to {self.max_batch}")
        if any(not 2 <= span <= self.max_len for span in spans):
            raise ValueError(f"spans must be 2 to {self.max_len}")  # a prompt has a token
        job = _Job(lambda: self._warm(sorted(set(batch_sizes)), sorted(set(spans))))
        began = time.monotonic()
        with self._wake:
            if self._closing:
                raise EngineClosed("the engine is closed")
            self._jobs.append(job)
            self._wake.notify()
        job.wait()
        return time.monotonic() - began

    def close(self) -> None:
        """Stop the step loop; unfinished requests end with EngineClosed."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- the step loop (engine thread) -------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._closing or self._pending or self._running or self._jobs):
                    self._wake.wait()
                if self._closing:
                    break
                job = self._jobs.popleft() if self._jobs and not self._running else None
                joining: list[tuple[int, RequestHandle]] = []
                # A waiting job lets running sequences finish before new ones join.
                while self._pending and self._free and not self._jobs and job is None:
                    joining.append((self._free.pop(), self._pending.popleft()))
            if job is not None:
                job.run()
                continue
            # A failing prefill or step fails its requests, not the engine.
            with torch.inference_mode():
                for slot, handle in joining:
                    try:
                        self._prefill(slot, handle)
                    except Exception as error:
                        handle._fail(error)
                        if self._running.get(slot) is handle:
                            self._release(slot)
                self._drop_cancelled()
                if self._running:
                    try:
                        self._decode()
                    except Exception as error:
                        for slot, handle in list(self._running.items()):
                            handle._fail(error)
                            self._release(slot)
        closed = EngineClosed("the engine closed before the request finished")
        with self._wake:
            leftovers = list(self._pending) + list(self._running.values())
            self._pending.clear()
            jobs = list(self._jobs)
            self._jobs.clear()
        for handle in leftovers:
            handle._fail(closed)
        for job in jobs:
            job.fail(closed)

    def _warm(self, batch_sizes: list[int], spans: list[int]) -> None:
        """Steps over free slots 0..size-1, rows at different lengths as continuous
        batching mixes them; token 0 stands for any token."""
        with torch.inference_mode():
            for size in batch_sizes:
                slots = list(range(size))
                for span in spans:
                    self._batch(slots, [0] * size, [max(span - 1 - row, 0) for row in slots])
        # The slots' caches now hold warm-up keys, all past their length of 0: never read.

    def _release(self, slot: int) -> None:
        del self._running[slot]
        self.lengths[slot] = 0
        with self._wake:
            self._free.append(slot)
            self._free.sort(reverse=True)

    def _drop_cancelled(self) -> None:
        for slot, handle in list(self._running.items()):
            if handle.cancelled:
                handle._events.put(None)
                self._release(slot)

    def _prefill(self, slot: int, handle: RequestHandle) -> None:
        """The prompt alone through the model's own forward (so its first token is
        `generate`'s), its keys and values copied into the slot. Blocks found in the prefix
        store are copied in first and the forward starts after them (its layers attend over
        them as cached positions); at least the last token is prefilled, for its logits."""
        self._running[slot] = handle
        if handle.cancelled:
            return
        prompt = handle.prompt_ids
        n = len(prompt)
        device = self.keys.device
        cache = self.model.new_cache(n)
        reused = 0
        if self.prefix is not None:
            for block_keys, block_values in self.prefix.lookup(prompt, n - 1):
                end = reused + block_keys.shape[2]
                cache.keys[:, 0, :, reused:end] = block_keys
                cache.values[:, 0, :, reused:end] = block_values
                reused = end
            cache.length = reused
        rest = torch.tensor([prompt[reused:]], dtype=torch.long, device=device)
        logits = self.model(rest, cache)
        self._prompt_tokens += n
        self._reused_tokens += reused
        if self.prefix is not None:
            self.prefix.store(prompt, cache.keys[:, 0], cache.values[:, 0])
        self.keys[:, slot, :, :n] = cache.keys[:, 0]
        self.values[:, slot, :, :n] = cache.values[:, 0]
        self.lengths[slot] = n
        self._clean[slot] = max(self._clean[slot], n)
        self._take(slot, handle, logits[0])

    def _take(self, slot: int, handle: RequestHandle, logits: torch.Tensor) -> None:
        if self.keep_logits:
            handle.logits.append(logits.clone())
        if handle._emit(int(logits.argmax())):
            self._release(slot)

    def _decode(self) -> None:
        """One new token for every running sequence, in one batched forward pass."""
        slots = sorted(self._running)
        last = [self._running[s].generated[-1] for s in slots]
        logits = self._batch(slots, last, [self.lengths[s] for s in slots])
        for row, slot in enumerate(slots):
            self.lengths[slot] += 1
            self._take(slot, self._running[slot], logits[row])

    def _batch(self, slots: list[int], last: list[int], lengths: list[int]) -> torch.Tensor:
        """Logits (batch, vocab) after token `last[i]` at position `lengths[i]` of each slot;
        its key and value are cached there. Lengths are not advanced."""
        device = self.keys.device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        positions = torch.tensor(lengths, dtype=torch.long, device=device)
        tokens = torch.tensor(last, dtype=torch.long, device=device)[:, None]  # (batch, 1)
        # Keys read: the longest sequence's with this token, padded up for CUDA graphs.
        span = -(-(max(lengths) + 1) // self._span_round) * self._span_round
        # At least 2 cached positions read (padding when fewer): a compiled graph traced with
        # 1 would specialise on it and fit no other span.
        span = min(max(span, 3), self.max_len)
        for slot in slots:
            if self._clean[slot] < span:
                self.keys[:, slot, :, self._clean[slot] : span] = 0
                self.values[:, slot, :, self._clean[slot] : span] = 0
                self._clean[slot] = span
        # Each row sees its own cached positions and, in the last column, its new token (its
        # key is not cached yet); the rest is padding.
        seen = torch.arange(span, device=device)[None, :]
        mask = (seen < positions[:, None]) | (seen == span - 1)
        mask = mask[:, None, None, :]  # (batch, 1 query head group, 1 query, span)
        rotary = self.model.rotary
        dtype = self.keys.dtype
        cos = rotary.cos[positions].to(dtype)[:, None, None, :]  # (batch, 1, 1, head_dim)
        sin = rotary.sin[positions].to(dtype)[:, None, None, :]
        return self._step(tokens, index, positions, mask, cos, sin)

    def _compile(self) -> tuple[Callable[..., torch.Tensor], int]:
        """`decode_layer` through torch.compile, and what spans round up to.

        On CPU Inductor fuses the small elementwise ops between the matmuls (norms, rotary,
        SwiGLU) and drops Python dispatch per op. On CUDA, CUDA graphs besides: replays
        instead of hundreds of kernel launches a step. A graph is recorded per shape, so
        spans round up to `CUDA_SPAN_ROUND` (the extra positions are masked), and the
        cache's address is marked fixed so it is read in place. (Untested: no GPU here.)"""
        if self.keys.device.type != "cuda":
            return torch.compile(decode_layer), 1
        for cache in (*self._layer_keys, *self._layer_values):
            torch._dynamo.mark_static_address(cache)  # else copied into the graph's inputs
        return torch.compile(decode_layer, mode="reduce-overhead"), CUDA_SPAN_ROUND

    def _step(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The batched forward pass: `decode_layer` for each layer, compiled when asked for,
        then every layer's new keys and values written into the cache at once."""
        backbone = self.model.model
        x = backbone.embed_tokens(tokens)
        run = decode_layer if self._compiled is None else self._compiled
        if self._compiled is not None:
            # Batch and span vary every step: marked dynamic so one graph serves them all. A
            # batch of 1 cannot be (a size-1 dim is specialised): it has a graph of its own.
            if tokens.shape[0] > 1:
                for t in (x, slots, mask, cos, sin):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(mask, 3)
            if self._span_round > 1:
                torch.compiler.cudagraph_mark_step_begin()  # last step's outputs are used up
        new_keys, new_values = [], []
        for layer, block in enumerate(backbone.layers):
            keys, values = self._layer_keys[layer], self._layer_values[layer]
            x, k, v = run(block, x, slots, mask, cos, sin, keys, values)
            new_keys.append(k)
            new_values.append(v)
        # Two index tensors around a slice: the indexed view is (batch, layers, kv_heads, d).
        self.keys[:, slots, :, positions] = torch.stack(new_keys, dim=1)
        self.values[:, slots, :, positions] = torch.stack(new_values, dim=1)
        return backbone.norm(x[:, -1]) @ backbone.embed_tokens.weight.T  # tied head


def decode_layer(
    block: DecoderLayer,
    x: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of a batched step: `x` (batch, 1, hidden), one new token per row of cache
    `slots` (batch,) whose cached keys and values (max_batch, kv_heads, max_len, head_dim)
    this layer's are; the output, and the new key and value (batch, kv_heads, head_dim).

    What `torch.compile` takes: tensors in and out, the cache only read. Written inside, the
    cache would be copied whole (functionalised) every step, and one function for every
    layer is one graph to compile, not thirty."""
    normed = block.input_layernorm(x)
    out, k, v = attend(block.self_attn, normed, slots, mask, cos, sin, keys, values)
    x = x + out
    return x + block.mlp(block.post_attention_layernorm(x)), k, v


def attend(
    attn: Attention,
    x: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of one new token per row over its slot's cached positions (the first
    span - 1, as `mask` allows) and itself (the mask's last column); the output, and the
    new key and value (batch, kv_heads, head_dim)."""
    batch, span = x.shape[0], mask.shape[-1]
    d = attn.head_dim

    def split(t: torch.Tensor, heads: int) -> torch.Tensor:  # (batch, heads, 1, d)
        return t.view(batch, 1, heads, d).transpose(1, 2)

    def rotate(t: torch.Tensor) -> torch.Tensor:  # as model.Rotary, a position per row
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-second, first], dim=-1) * sin

    q = rotate(split(attn.q_proj(x), attn.heads))
    k = rotate(split(attn.k_proj(x), attn.kv_heads))
    v = split(attn.v_proj(x), attn.kv_heads)
    seen_keys = torch.cat([keys[slots, :, : span - 1], k], dim=2)  # (batch, kv_heads, span, d)
    seen_values = torch.cat([values[slots, :, : span - 1], v], dim=2)
    out = functional.scaled_dot_product_attention(
        q, seen_keys, seen_values, attn_mask=mask, enable_gqa=True
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1)), k[:, :, 0], v[:, :, 0]
