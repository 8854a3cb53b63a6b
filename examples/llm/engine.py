"""Continuous batching for the decoder of `model.py`: many generations, one forward pass
per step for all of them.

A preallocated KV cache holds `max_batch` sequences, one slot each
(`[layers, max_batch, kv_heads, max_len + draft_len, head_dim]` with a filled length per
slot). A background thread loops: requests waiting for a slot join (their prompt is
prefilled alone, through the model's own single-sequence forward, and copied into the
slot), then every running sequence decodes in a single batched pass, attention masked to
each slot's own positions; a sequence leaves after a stop id or `max_new_tokens`, freeing
its slot for the next step.

Prefix caching: after a prefill the prompt's keys and values are kept in blocks of
`PREFIX_BLOCK` tokens (`PrefixStore`, LRU within `prefix_cache_bytes`); a later prompt that
starts with the same blocks (a system prompt, chat history) copies them in and prefills only
the rest, at least its last token, whose logits give the first new token.

Speculative decoding by prompt lookup (`draft_len` > 0): in steps of at most
`draft_batch_limit` sequences, each greedy sequence whose last n-gram occurred earlier in
its prompt or output feeds what followed it there as a draft after its last token; the
one pass gives the logits after every fed token, the drafts matching the greedy choices
are kept and one token more. Lossless: the tokens are those of decoding one at a time.

Sampling: a request's `Sampling(temperature, top_p, seed)` draws each token from the
softmax at that temperature within the top-p nucleus, with a generator of its own (seeded:
the same tokens whatever else shares the steps); temperature 0, the default, is greedy.

    engine = Engine(model, max_batch=8, draft_len=8)
    handle = engine.submit(prompt_ids, max_new_tokens=32, stop_ids={eos})
    for token in handle.tokens(): ...
    outputs = engine.generate_many([prompt_a, prompt_b], max_new_tokens=32)
    engine.close()

`Engine(model, compile=True)` runs each layer of the one-token batched step through
`torch.compile` (`decode_layer`: one graph serves all thirty layers; batch size and span
are dynamic, so a batch of 1 and any other batch are the only two graphs; steps verifying
drafts run eager). Call `engine.warm()` before a snapshot (`enter(snap=True)`) so
compiling happens there, not in a replica's first requests. Prefill stays eager: a prompt
runs once and its length varies freely. On a CUDA model the compiled step also replays
CUDA graphs (`mode="reduce-overhead"`), spans rounded up to `CUDA_SPAN_ROUND`, and
`warm()` records every (batch, span) shape. On a 2-core CPU compiling SmolLM2-135M took 8
to 22 s and decoded within a few per cent of eager (the step is bound by reading the
weights).

Greedy tokens equal `model.generate`'s one request at a time, up to rounding: a batched
matmul may sum in another order than a one-row one, which moves logits in their last bits
and could flip an argmax between two (near-)equal logits.
"""

from __future__ import annotations

import hashlib
import queue
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
from prompt_lookup import find_draft
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


@dataclass(frozen=True)
class Sampling:
    """How a request picks each token: greedy at temperature 0 (the default), else drawn
    from the softmax at `temperature` within the smallest set of tokens whose probability
    reaches `top_p`, by a generator seeded with `seed` (random when None)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass
class LookupCounts:
    """Speculative decoding in an engine, counted by its thread."""

    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, equal to the greedy choice (and so output)
    tokens: int = 0  # tokens generated by decoding steps
    row_steps: int = 0  # sequences times steps


class RequestHandle:
    """One submitted generation; its tokens arrive through `tokens()` as they are decoded."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: frozenset[int],
        sampling: Sampling = GREEDY,
        speculate: bool = True,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.sampling = sampling
        # Drafts by prompt lookup are verified against greedy choices: greedy requests only.
        self.speculate = speculate and sampling.greedy
        self.generator: torch.Generator | None = None  # made on the engine's device
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
        draft_len: int = 0,
        ngram: int = 3,
        draft_batch_limit: int = 2,
    ) -> None:
        config = model.config
        if not 1 <= max_len <= config.max_position_embeddings - draft_len:
            raise ValueError(f"max_len must be 1 to {config.max_position_embeddings - draft_len}")
        if draft_len < 0 or ngram < 1:
            raise ValueError("draft_len must be >= 0 and ngram >= 1")
        self.model = model
        self.max_batch = max_batch
        self.max_len = max_len
        self.draft_len = draft_len  # 0: no speculative decoding
        self.ngram = ngram
        # Steps with more sequences than this decode one token each: a full batch already
        # uses the compute that verifying drafts would need (weights are read once a step
        # either way, which is what drafts save at small batches).
        self.draft_batch_limit = draft_batch_limit
        self.lookup = LookupCounts()
        self.keep_logits = keep_logits  # for tests that compare logits, not only argmaxes
        # Touched by the engine thread only; None when prefix caching is off.
        self.prefix = PrefixStore(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._prompt_tokens = 0
        self._reused_tokens = 0
        weight = model.model.embed_tokens.weight
        # Room past max_len for the drafts a verification pass writes after a sequence's
        # last position (padding rows with shorter drafts write there too).
        shape = (
            config.num_hidden_layers,
            max_batch,
            config.num_key_value_heads,
            max_len + draft_len,
        )
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
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: Iterable[int] = (),
        sampling: Sampling = GREEDY,
        speculate: bool = True,
    ) -> RequestHandle:
        """Queue a generation; `speculate=False` turns prompt-lookup drafts off for it (they
        are only ever used for greedy requests, in an engine with `draft_len` > 0)."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if len(prompt_ids) + max_new_tokens > self.max_len:
            raise ValueError(
                f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the "
                f"engine's {self.max_len} positions a sequence"
            )
        handle = RequestHandle(
            list(prompt_ids), max_new_tokens, frozenset(stop_ids), sampling, speculate
        )
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

    def lookup_stats(self) -> dict[str, float]:
        """Speculative decoding so far: draft tokens proposed and accepted, the acceptance
        rate, and tokens generated per sequence step (1.0 without drafts)."""
        counts = self.lookup
        return {
            "proposed": counts.proposed,
            "accepted": counts.accepted,
            "acceptance_rate": counts.accepted / counts.proposed if counts.proposed else 0.0,
            "tokens_per_step": counts.tokens / counts.row_steps if counts.row_steps else 0.0,
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
                    self._batch(slots, [[0]] * size, [max(span - 1 - row, 0) for row in slots])
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
        if handle._emit(self._pick(handle, logits)):
            self._release(slot)

    def _pick(self, handle: RequestHandle, logits: torch.Tensor) -> int:
        sampling = handle.sampling
        if sampling.greedy:
            return int(logits.argmax())
        if handle.generator is None:
            # Per request, so a seed gives the same tokens whatever else is running; an
            # unseeded one draws from the OS (a restored snapshot must not replay it).
            seed = secrets.randbits(63) if sampling.seed is None else sampling.seed
            handle.generator = torch.Generator(device=logits.device).manual_seed(seed)
        probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            # Keep tokens while the mass before them is under top_p: at least the first.
            ordered = ordered * ((ordered.cumsum(0) - ordered) < sampling.top_p)
            return int(order[torch.multinomial(ordered, 1, generator=handle.generator)])
        return int(torch.multinomial(probs, 1, generator=handle.generator))

    def _decode(self) -> None:
        """New tokens for every running sequence, in one batched forward pass: one each, or
        with prompt-lookup drafts, the accepted drafts and one more."""
        slots = sorted(self._running)
        handles = [self._running[s] for s in slots]
        if len(slots) <= self.draft_batch_limit:
            drafts = [self._draft(handle) for handle in handles]
        else:
            drafts = [[] for _ in handles]
        width = 1 + max(map(len, drafts))
        # Each row feeds its last token and its draft; rows with shorter drafts are padded
        # with token 0, at positions past what the row keeps, whose logits are never read.
        feed = [
            [h.generated[-1], *draft, *[0] * (width - 1 - len(draft))]
            for h, draft in zip(handles, drafts, strict=True)
        ]
        logits = self._batch(slots, feed, [self.lengths[s] for s in slots])
        for row, (slot, handle, draft) in enumerate(zip(slots, handles, drafts, strict=True)):
            accepted = 0
            if draft:
                choices = logits[row, : len(draft)].argmax(dim=-1).tolist()
                while accepted < len(draft) and draft[accepted] == choices[accepted]:
                    accepted += 1
                self.lookup.proposed += len(draft)
                self.lookup.accepted += accepted
            self.lookup.row_steps += 1
            # The fed token and the accepted drafts are cached; each step's pick is the
            # greedy token after it, equal to the next draft for the accepted ones.
            for column in range(accepted + 1):
                self.lengths[slot] += 1
                self.lookup.tokens += 1
                self._take(slot, handle, logits[row, column])
                if self._running.get(slot) is not handle:
                    break  # finished (stop id or length): the rest of the drafts are dropped

    def _draft(self, handle: RequestHandle) -> list[int]:
        """Tokens that followed the sequence's last n-gram earlier in its prompt or output,
        as many as may still be generated after the token this step adds."""
        room = min(self.draft_len, handle.max_new_tokens - len(handle.generated) - 1)
        if room <= 0 or not handle.speculate:
            return []
        return find_draft(handle.prompt_ids + handle.generated, self.ngram, room)

    def _batch(self, slots: list[int], feed: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """Logits (batch, width, vocab) after each of the `width` tokens of `feed[i]`, fed at
        positions `lengths[i]`, `lengths[i] + 1`, ... of slot `slots[i]`; their keys and
        values are cached there. Lengths are not advanced."""
        device = self.keys.device
        width = len(feed[0])
        index = torch.tensor(slots, dtype=torch.long, device=device)
        starts = torch.tensor(lengths, dtype=torch.long, device=device)
        offsets = torch.arange(width, device=device)
        positions = starts[:, None] + offsets[None, :]  # (batch, width)
        tokens = torch.tensor(feed, dtype=torch.long, device=device)
        # Cached positions read: the longest sequence's, padded up for CUDA graphs; at least
        # 2 (padding when fewer): a compiled graph traced with 1 would fit no other span.
        cached = -(-(max(lengths) + 1) // self._span_round) * self._span_round - 1
        cached = min(max(cached, 2), self.max_len - 1)
        # Zeroed up to what this step writes, so that later steps never zero a written key.
        clean = min(cached + width, self.keys.shape[3])
        for slot in slots:
            if self._clean[slot] < clean:
                self.keys[:, slot, :, self._clean[slot] : clean] = 0
                self.values[:, slot, :, self._clean[slot] : clean] = 0
                self._clean[slot] = clean
        # Each row's tokens see its own cached positions, then the new tokens up to their
        # own (their keys are not cached yet); the rest is padding.
        seen = torch.arange(cached, device=device)[None, None, :] < starts[:, None, None]
        causal = offsets[None, :] <= offsets[:, None]  # (width, width)
        mask = torch.cat([seen.expand(-1, width, -1), causal.expand(len(slots), -1, -1)], dim=-1)[
            :, None
        ]  # (batch, 1 query head group, width, cached + width)
        rotary = self.model.rotary
        dtype = self.keys.dtype
        cos = rotary.cos[positions].to(dtype)[:, None]  # (batch, 1, width, head_dim)
        sin = rotary.sin[positions].to(dtype)[:, None]
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
        """The batched forward pass: `decode_layer` for each layer, compiled when asked for
        (one token a row; verifying drafts runs eager), then every layer's new keys and
        values written into the cache at once."""
        backbone = self.model.model
        x = backbone.embed_tokens(tokens)
        compiled = self._compiled is not None and tokens.shape[1] == 1
        run = self._compiled if compiled else decode_layer
        if compiled:
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
        # Index tensors around a slice: the indexed view is (batch, width, layers, kv_heads,
        # d); each layer's are (batch, kv_heads, width, d).
        rows = slots[:, None]
        self.keys[:, rows, :, positions] = torch.stack(new_keys).permute(1, 3, 0, 2, 4)
        self.values[:, rows, :, positions] = torch.stack(new_values).permute(1, 3, 0, 2, 4)
        return backbone.norm(x) @ backbone.embed_tokens.weight.T  # tied head


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
    """One layer of a batched step: `x` (batch, width, hidden), `width` new tokens per row
    of cache `slots` (batch,) whose cached keys and values (max_batch, kv_heads, positions,
    head_dim) this layer's are; the output, and the new keys and values (batch, kv_heads,
    width, head_dim).

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
    """Attention of each row's new tokens over its slot's first `cached` positions and the
    new tokens themselves (the mask's last `width` columns), as `mask` (batch, 1, width,
    cached + width) allows; the output, and the new keys and values."""
    batch, width = x.shape[0], x.shape[1]
    cached = mask.shape[-1] - width
    d = attn.head_dim

    def split(t: torch.Tensor, heads: int) -> torch.Tensor:  # (batch, heads, width, d)
        return t.view(batch, width, heads, d).transpose(1, 2)

    def rotate(t: torch.Tensor) -> torch.Tensor:  # as model.Rotary, a position per token
        first, second = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-second, first], dim=-1) * sin

    q = rotate(split(attn.q_proj(x), attn.heads))
    k = rotate(split(attn.k_proj(x), attn.kv_heads))
    v = split(attn.v_proj(x), attn.kv_heads)
    seen_keys = torch.cat([keys[slots, :, :cached], k], dim=2)  # (batch, kv, cached+width, d)
    seen_values = torch.cat([values[slots, :, :cached], v], dim=2)
    out = functional.scaled_dot_product_attention(
        q, seen_keys, seen_values, attn_mask=mask, enable_gqa=True
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1)), k, v
