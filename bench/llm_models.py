"""Model folders for examples/llm with random weights of real architectures' shapes.

A benchmark of starts needs a model's size and shapes, not its answers: these folders
hold what `EMBER_LLM_CONVERT=0` asks of `EMBER_LLM_DIR` (config.json, model.safetensors,
tokenizer.json, chat_template.jinja), written here in seconds, with nothing downloaded.
The weights are fp32 like convert.py's, seeded, drawn tensor by tensor so that a
multi-GB file never sits in memory whole. The tokenizer is a word-level one over the
vocabulary's size (`<t0>`, `<t1>`, ...): requests give token ids anyway.

Run as a script, it writes each shape's folder and checks it as the benchmarks use it:
the example's decoder loads it (`model.load_model`, every tensor), and greedy decoding
after gpu_coldstart.py's prompt gives `--tokens` tokens, none repeated (the verdict).
Printed per shape: the weights' size, the seconds to write them (and to find them
written, a second time), to load them and to decode, and the smallest and the median gap
between a step's top two logits (a near-tie that rounding in another kernel could flip
would make a restored replica's tokens differ from a cold one's for no fault of the
restore).

    .venv/bin/python bench/llm_models.py                  # 135m,360m,1.7b: a few minutes
    .venv/bin/python bench/llm_models.py --quick          # 135m's shape, 2 layers
    .venv/bin/python bench/llm_models.py --models 360m --layers 4 --out DIR --json

A run that fails part-way prints the shapes it checked before, and where it failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm"
SEED = 0
# Chosen so that greedy decoding neither repeats one token (a tiny spread lets the
# residual stream, the input's embedding, win every step) nor sits on near-ties that any
# rounding flips: 16 different tokens after the benchmarks' prompt, the top two logits
# apart by 0.012 or more at every step (running this file measures it: 0.016 with 2 layers
# of SmolLM2-135M's shape, 0.012 with its 30), some 100 times what summing in another
# order moves an fp32 logit here.
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


# ===================================================================================
# The check, run as a script.
# ===================================================================================


def greedy(folder: Path, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Load `folder` with the example's decoder and decode `tokens` greedily after
    `prompt`: the tokens, the smallest gap between a step's top two logits, the times."""
    import torch

    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import load_model
    finally:
        sys.path.remove(str(EXAMPLE))
    began = time.perf_counter()
    model = load_model(folder)
    loaded = time.perf_counter()
    out: list[int] = []
    gaps: list[float] = []
    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + tokens)
        ids = torch.tensor([prompt], dtype=torch.long)
        for _ in range(tokens):
            logits = model(ids, cache)[0]
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]], dtype=torch.long)
    decoded = time.perf_counter()
    return {
        "tokens": out,
        "distinct_tokens": len(set(out)),
        "smallest_gap": min(gaps),
        "median_gap": statistics.median(gaps),
        "load_seconds": loaded - began,
        "decode_seconds": decoded - loaded,
    }


def check(name: str, folder: Path, layers: int | None, tokens: int) -> dict[str, Any]:
    from gpu_coldstart import PROMPT  # the prompt the models' numbers above were chosen on

    shape = SHAPES[name]
    began = time.perf_counter()
    size = write_model(folder, shape, layers)
    written = time.perf_counter()
    write_model(folder, shape, layers)  # found complete: nothing written again
    again = time.perf_counter()
    decoded = greedy(folder, PROMPT, tokens)
    return {
        "model": name,
        "layers": layers or shape.num_hidden_layers,
        "weight_bytes": size,
        "write_seconds": written - began,
        "again_seconds": again - written,
        **decoded,
        "verdicts": {"no_repeat": decoded["distinct_tokens"] == tokens},
    }


def report(result: dict[str, Any]) -> str:
    def mark(passed: bool) -> str:
        return "PASS" if passed else "MISS"

    lines = [
        f"model folders for examples/llm, random fp32 weights (seed {SEED}), greedy after "
        f"gpu_coldstart.py's prompt, {result['tokens']} tokens",
        "",
        f"{'model':8}{'layers':>7}{'GB':>7}{'write s':>9}{'again s':>9}{'load s':>8}"
        f"{'decode s':>10}{'distinct':>10}{'min gap':>9}{'median gap':>12}",
    ]
    for row in result["models"]:
        lines.append(
            f"{row['model']:8}{row['layers']:>7}{row['weight_bytes'] / 1e9:>7.2f}"
            f"{row['write_seconds']:>9.2f}{row['again_seconds']:>9.3f}{row['load_seconds']:>8.2f}"
            f"{row['decode_seconds']:>10.2f}{row['distinct_tokens']:>10}"
            f"{row['smallest_gap']:>9.3f}{row['median_gap']:>12.3f}"
        )
    lines.append("")
    for row in result["models"]:
        lines.append(
            f"{row['model']}: {row['distinct_tokens']} of {result['tokens']} greedy tokens "
            f"different: {mark(row['verdicts']['no_repeat'])}"
        )
    if "failed" in result:
        lines.append(f"FAILED in {result['failed']['part']}: {result['failed']['error']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/llm_models.py",
        description="Write model folders of SmolLM2's shapes with random weights and check "
        "that examples/llm loads them and decodes tokens none of which repeats; prints the "
        "gaps between the top two logits.",
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error.",
    )
    parser.add_argument(
        "--models",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        help=f"shapes, in order (of {', '.join(SHAPES)}; default: all; --quick: 135m)",
    )
    parser.add_argument(
        "--layers", type=int, help="fewer layers than the shape's (default: all; --quick: 2)"
    )
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens (default: 16)")
    parser.add_argument(
        "--out",
        type=Path,
        help="write the folders here, one per shape, and keep them (default: a temporary "
        "folder, removed after)",
    )
    parser.add_argument("--quick", action="store_true", help="135m's shape with 2 layers")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = ["135m"] if args.quick else list(SHAPES)
    if args.layers is None and args.quick:
        args.layers = 2
    if unknown := [m for m in args.models if m not in SHAPES]:
        parser.error(f"--models: unknown {', '.join(unknown)} (of {', '.join(SHAPES)})")
    if args.tokens < 1 or (args.layers or 1) < 1:
        parser.error("--tokens and --layers must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"tokens": args.tokens, "models": []}
    root = args.out or Path(tempfile.mkdtemp(prefix="ember-llm-models-"))
    try:
        for name in args.models:
            print(f"{name}: writing, loading, decoding ...", file=sys.stderr, flush=True)
            result["models"].append(check(name, root / name, args.layers, args.tokens))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # the shapes checked before are printed all the same
        result["failed"] = {"part": name, "error": f"{type(error).__name__}: {error}"}
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else report(result))
    if "failed" in result:
        failed = result["failed"]
        print(f"bench/llm_models.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    passed = all(all(row["verdicts"].values()) for row in result["models"])
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
