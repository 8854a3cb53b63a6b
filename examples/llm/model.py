"""A Llama-architecture decoder in plain torch, with a KV cache and greedy decoding.

Pre-norm blocks of RMSNorm, attention with rotary position embeddings and grouped-query
heads (a few key/value heads shared by several query heads), and a SwiGLU MLP; the output
head is the token embedding (tied). Submodules are named as Llama checkpoints name their
tensors, so the weights of `convert.py` load by name:

    model = load_model(out_dir)                    # config.json + model.safetensors
    ids = chat_prompt_ids(out_dir, [{"role": "user", "content": "Hi"}])
    for token in model.generate(ids, max_new_tokens=32, stop_ids={eos}): ...
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> LlamaConfig:
        if not config.get("tie_word_embeddings", False):
            raise ValueError("this decoder ties its output head to the embedding")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}")
        if config.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported")
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config.get("rope_theta", 10_000.0),
            vocab_size=config["vocab_size"],
            max_position_embeddings=config["max_position_embeddings"],
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the model's dtype: the mean of squares overflows fp16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """cos and sin tables for every position; a head's two halves rotate as pairs (i, i+d/2)."""

    def __init__(self, head_dim: int, theta: float, positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.positions = head_dim, theta, positions
        # Not in the checkpoint (persistent=False), so a strict load does not ask for them.
        self.register_buffer("cos", torch.empty(positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(positions, head_dim), persistent=False)
        self.fill()

    @torch.no_grad()
    def fill(self) -> None:
        """Compute the tables (again after `to_empty`, which leaves buffers uninitialised)."""
        if self.cos.is_meta:
            return
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.cos.device)
        inverse = 1.0 / self.theta ** (steps / self.head_dim)
        positions = torch.arange(self.positions, dtype=torch.float32, device=self.cos.device)
        angles = torch.outer(positions, inverse)
        angles = torch.cat([angles, angles], dim=-1)  # (positions, head_dim)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate x (batch, heads, length, head_dim) as positions start, start+1, ..."""
        length = x.shape[-2]
        cos = self.cos[start : start + length].to(x.dtype)
        sin = self.sin[start : start + length].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin


class KVCache:
    """Keys and values of every layer for one sequence, preallocated to `capacity` positions."""

    def __init__(
        self, config: LlamaConfig, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_hidden_layers, 1, config.num_key_value_heads, capacity)
        self.keys = torch.zeros(*shape, config.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0  # positions filled (and so the position of the next token)
        self.capacity = capacity

    def append(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (1, kv_heads, n, head_dim) at start..start+n; all keys and values so far."""
        end = start + k.shape[-2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: Rotary) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(hidden, self.heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, hidden, bias=False)
        self.rotary = [rotary]  # in a list: shared by every layer, not a submodule of each

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        batch, length, _ = x.shape
        start = cache.length

        def split(t: torch.Tensor, heads: int) -> torch.Tensor:  # (batch, heads, length, d)
            return t.view(batch, length, heads, self.head_dim).transpose(1, 2)

        rotary = self.rotary[0]
        q = rotary(split(self.q_proj(x), self.heads), start)
        k = rotary(split(self.k_proj(x), self.kv_heads), start)
        keys, values = cache.append(layer, start, k, split(self.v_proj(x), self.kv_heads))
        if start == 0:
            mask, causal = None, length > 1
        elif length == 1:
            mask, causal = None, False  # one new token sees every cached position
        else:
            # New tokens at start..start+length-1 see the cache and the new ones up to theirs.
            seen = torch.arange(start + length, device=x.device)
            mine = torch.arange(start, start + length, device=x.device)
            mask, causal = seen[None, :] <= mine[:, None], False
        out = functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Llama's `model.*`: embedding, layers, final norm."""

    def __init__(self, config: LlamaConfig, rotary: Rotary) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaDecoder(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.model = Backbone(config, self.rotary)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        weight = self.model.embed_tokens.weight
        capacity = capacity or self.config.max_position_embeddings
        return KVCache(self.config, capacity, weight.dtype, weight.device)

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the token after the last of `ids` (1, length) -> (1, vocab); appends
        the new positions to `cache`."""
        return self.logits(self.hidden_states(ids, cache)[:, -1])

    def hidden_states(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The final normalised states of every position of `ids` (1, length, hidden),
        appended to `cache`: a draft's verification needs each position's logits."""
        if cache.length + ids.shape[1] > cache.capacity:
            raise ValueError(f"{cache.length + ids.shape[1]} positions exceed {cache.capacity}")
        x = self.model.embed_tokens(ids)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, index, cache)
        cache.length += ids.shape[1]
        return self.model.norm(x)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return states @ self.model.embed_tokens.weight.T  # tied output head

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
    ) -> Iterator[int]:
        """Greedy tokens after the prompt, one at a time, ending after a stop id (yielded)."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        stops = set(stop_ids)
        device = self.model.embed_tokens.weight.device
        cache = self.new_cache(
            min(len(prompt_ids) + max_new_tokens, self.config.max_position_embeddings)
        )
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        for _ in range(max_new_tokens):
            token = int(self(ids, cache).argmax(dim=-1))
            yield token
            if token in stops:
                return
            ids = torch.tensor([[token]], dtype=torch.long, device=device)


def empty_model(directory: Path) -> LlamaDecoder:
    """The decoder sized by `directory`/config.json, its parameters allocated but not
    initialised (they are about to be loaded), its rotary tables computed."""
    config = LlamaConfig.from_json(json.loads((directory / "config.json").read_text()))
    with torch.device("meta"):
        model = LlamaDecoder(config)
    # Built on the meta device: no time spent initialising weights about to be replaced.
    model = model.to_empty(device="cpu")
    model.rotary.fill()
    return model.eval().requires_grad_(False)


def load_model(directory: Path) -> LlamaDecoder:
    """The converted model in `directory` (config.json, model.safetensors), weights read
    through Ember's weights API by a file:// URL."""
    import ember.weights

    model = empty_model(directory)
    url = (directory.resolve() / "model.safetensors").as_uri()
    ember.weights.open(url).load_into(model, strict=True)
    return model


class ChatTemplate:
    """The model's chat template (`chat_template.jinja`) and tokenizer, loaded once."""

    def __init__(self, directory: Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # Sandboxed, with the whitespace options transformers renders templates with.
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = environment.from_string((directory / "chat_template.jinja").read_text())
        self.tokenizer = tokenizer(directory)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` rendered, ready for the assistant's reply."""
        text = self.template.render(messages=messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def chat_prompt_ids(directory: Path, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the model's chat template, ready for the reply."""
    return ChatTemplate(directory).prompt_ids(messages)


def tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))
