"""Model folders for examples/llm with random weights of real architectures' shapes.

A benchmark of starts needs a model's size and shapes, not its answers: these folders
hold what `EMBER_LLM_CONVERT=0` asks of `EMBER_LLM_DIR` (config.json, model.safetensors,
tokenizer.json, chat_template.jinja), written here in seconds, with nothing downloaded.
The weights are fp32 like convert.py's, seeded, drawn tensor by tensor so that a
multi-GB file never sits in memory whole. The tokenizer is a word-level one over the
vocabulary's size (`<t0>`, `<t1>`, ...): requests give token ids anyway.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm"
SEED = 0
# Chosen so that greedy decoding neither repeats one token (a tiny spread lets the
# residual stream, the input's embedding, win every step) nor sits on near-ties that any
# rounding flips: 16 different tokens after the benchmarks' prompt, the top two logits
# apart by 0.16 or more (tried on 2 and 30 layers of SmolLM2-135M's shape).
EMBEDDING_SCALE = 2.0
INIT_STD = 0.05


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture decoder with a tied output head (SmolLM2's family)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 64
    vocab_size: int = 49152
    rope_theta: float = 100_000.0

    def config(self, layers: int | None = None) -> dict[str, Any]:
        """config.json in Hugging Face's keys (what examples/llm/model.py reads)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": layers or self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "torch_dtype": "float32",
        }


# The shapes of SmolLM2's published sizes (their config.json files).
SHAPES = {
    "135m": Shape(576, 1536, 30, 9, 3),  # 0.54 GB of fp32 weights
    "360m": Shape(960, 2560, 32, 15, 5),  # 1.45 GB
    "1.7b": Shape(2048, 8192, 24, 32, 32, rope_theta=130_000.0),  # 6.8 GB
}


def write_model(folder: Path, shape: Shape, layers: int | None = None) -> int:
    """Write the model folder; returns the weights' bytes. Nothing is written again when
    `folder` already holds this model (its config.json says so)."""
    config = shape.config(layers)
    done = folder / "config.json"
    if done.exists() and json.loads(done.read_text()) == config:
        return (folder / "model.safetensors").stat().st_size
    folder.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)  # written last: marks the folder complete
    size = _write_weights(folder / "model.safetensors", config)
    _write_tokenizer(folder / "tokenizer.json", config["vocab_size"])
    # Enough for the chat path to render something; the benchmarks send token ids.
    (folder / "chat_template.jinja").write_text(
        "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    )
    done.write_text(json.dumps(config, indent=2) + "\n")
    return size


def _state_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the example's decoder loads, by name, from a model on the meta
    device (no memory)."""
    import torch

    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import LlamaConfig, LlamaDecoder
    finally:
        sys.path.remove(str(EXAMPLE))
    with torch.device("meta"):
        model = LlamaDecoder(LlamaConfig.from_json(config))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _write_weights(path: Path, config: dict[str, Any]) -> int:
    """safetensors by hand (an 8-byte header length, a JSON header, the tensors' bytes):
    streamed a tensor at a time."""
    import torch

    shapes = _state_shapes(config)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shapes.items():
        count = 1
        for dim in dims:
            count *= dim
        header[name] = {
            "dtype": "F32",
            "shape": list(dims),
            "data_offsets": [offset, offset + 4 * count],
        }
        offset += 4 * count
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    generator = torch.Generator().manual_seed(SEED)
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, dims in shapes.items():
            if name.endswith("norm.weight"):
                tensor = torch.ones(dims)
            else:
                tensor = torch.randn(dims, generator=generator) * INIT_STD
                if name == "model.embed_tokens.weight":
                    tensor *= EMBEDDING_SCALE
            file.write(tensor.numpy().tobytes())
    partial.replace(path)
    return path.stat().st_size


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
