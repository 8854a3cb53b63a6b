"""A decoder-only transformer (~430 MB of fp32 weights) warmed with `torch.compile`.

`enter(snap=True)` does everything slow: import torch, build the model (seeded, no
download), compile it and run it until compilation is done. With snapshots (the
default) that happens once per endpoint version; later replicas restore the compiled,
warm process. bench/coldstart.py times both paths.

    ember deploy examples/transformer/app.py
    ember call transformer--lm/generate '{"prompt_ids": [1, 2, 3, 4], "max_new_tokens": 8}'

`ember deploy` imports this file to read its settings, so four of them come from the
environment of `ember deploy` (not of the replicas): EMBER_EXAMPLE_SNAPSHOT=0 turns
snapshots off, EMBER_EXAMPLE_SCALEDOWN sets the scale-down window in seconds,
EMBER_EXAMPLE_WEIGHTS=URL loads the weights from a safetensors file (`save_weights`
writes the seeded ones) through `weights=` instead of building them: kept as mappings of
the node's weights cache, they stay out of the snapshot image; and
EMBER_EXAMPLE_COMPILE_CACHE=DIR gives the replicas Inductor's compile cache there (a
folder they can reach), instead of each replica's own under its private /tmp.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import ember

if TYPE_CHECKING:
    import torch

SNAPSHOT = os.environ.get("EMBER_EXAMPLE_SNAPSHOT", "1") != "0"
SCALEDOWN_WINDOW = float(os.environ.get("EMBER_EXAMPLE_SCALEDOWN", "60"))
# Replicas import this file again, without the deploy's environment: `env=` hands them
# the URL under a name of the app's own (EMBER_ names are the platform's).
REPLICA_WEIGHTS_ENV = "TRANSFORMER_WEIGHTS_URL"
WEIGHTS_URL = os.environ.get("EMBER_EXAMPLE_WEIGHTS") or os.environ.get(REPLICA_WEIGHTS_ENV)
COMPILE_CACHE = os.environ.get("EMBER_EXAMPLE_COMPILE_CACHE")
REPLICA_ENV = {
    **({REPLICA_WEIGHTS_ENV: WEIGHTS_URL} if WEIGHTS_URL else {}),
    **({"TORCHINDUCTOR_CACHE_DIR": COMPILE_CACHE} if COMPILE_CACHE else {}),
}

VOCAB = 32_000
D_MODEL = 1024
HEADS = 16
LAYERS = 6
CONTEXT = 128  # longest prompt + generated tokens
SEED = 0
# Sequence lengths run while warming. Dynamo specializes length 1, and compiles one
# graph with a symbolic length for the rest: these cover both, so no request compiles.
WARM_LENGTHS = (1, 2, 5)


def build_model(seed: int | None) -> torch.nn.Module:
    """GPT-style: learned positions, pre-norm blocks, an output head tied to the embedding.
    Without a seed its tensors are on the meta device (no memory): weights come later."""
    import torch
    from torch import nn
    from torch.nn import functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(D_MODEL)
            self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
            self.out = nn.Linear(D_MODEL, D_MODEL, bias=False)
            self.norm2 = nn.LayerNorm(D_MODEL)
            self.up = nn.Linear(D_MODEL, 4 * D_MODEL, bias=False)
            self.down = nn.Linear(4 * D_MODEL, D_MODEL, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, length, _ = x.shape
            qkv = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, D_MODEL // HEADS)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attended.transpose(1, 2).reshape(batch, length, D_MODEL))
            return x + self.down(functional.gelu(self.up(self.norm2(x))))

    class DecoderLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, D_MODEL)
            self.positions = nn.Embedding(CONTEXT, D_MODEL)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(D_MODEL)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            """Logits of the token after the last one: (batch, length) -> (batch, VOCAB)."""
            positions = torch.arange(ids.shape[1], device=ids.device)
            x = self.tokens(ids) + self.positions(positions)
            for block in self.blocks:
                x = block(x)
            return self.norm(x[:, -1]) @ self.tokens.weight.T

    if seed is None:
        with torch.device("meta"):
            return DecoderLM().eval().requires_grad_(False)
    torch.manual_seed(seed)
    model = DecoderLM()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.02)  # GPT-2's init: logits of a sane scale
    return model.eval().requires_grad_(False)


def save_weights(path: str) -> None:
    """Write the seeded model's weights as safetensors, for EMBER_EXAMPLE_WEIGHTS."""
    from safetensors.torch import save_file

    save_file(build_model(SEED).state_dict(), path)


@ember.endpoint(
    name="lm",
    max_replicas=2,
    concurrency=1,  # one decode uses every core this machine has
    scaledown_window=SCALEDOWN_WINDOW,
    timeout=600,
    cpu=1.0,
    memory=3072,
    snapshot=SNAPSHOT,
    weights={"model": WEIGHTS_URL} if WEIGHTS_URL else None,
    env=REPLICA_ENV or None,
)
class LanguageModel:
    @ember.enter(snap=True)
    def load(self) -> None:
        # Before torch is imported: Inductor then compiles in this process. With more
        # threads it starts a pool of worker processes that outlives compilation, and a
        # snapshot would have to dump (and every restore recreate) all of them.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        began = time.monotonic()
        import torch

        imported = time.monotonic()
        weights = getattr(self, "weights", {})
        if "model" in weights:
            # Views of the node cache's file, not copies: the snapshot maps them again.
            model = build_model(None)
            model.load_state_dict(weights["model"].state_dict(), assign=True)
        else:
            model = build_model(SEED)
        built = time.monotonic()
        self.torch = torch
        self.compiled = torch.compile(model, dynamic=True)
        with torch.no_grad():
            for length in WARM_LENGTHS:
                self.compiled(torch.zeros(1, length, dtype=torch.long))
        compiled = time.monotonic()
        self.parameter_count = sum(p.numel() for p in model.parameters())
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.boot = {
            "import_seconds": round(imported - began, 3),
            "build_seconds": round(built - imported, 3),
            "compile_seconds": round(compiled - built, 3),
        }
        print(
            f"model ready: {self.parameter_count / 1e6:.0f} M parameters "
            f"({self.weight_bytes / 1e6:.0f} MB fp32); import torch {imported - began:.1f} s, "
            f"build {built - imported:.1f} s, compile and warm {compiled - built:.1f} s",
            flush=True,
        )

    @ember.enter()
    def ready(self) -> None:
        # After every start and restore; nothing heavy. The platform has reseeded the RNGs
        # (decoding is greedy anyway). A restore may land on a node with another CPU
        # count than the snapshot's: use the CPUs this process may use now.
        cpus = len(os.sched_getaffinity(0))
        if self.torch.get_num_threads() != cpus:
            self.torch.set_num_threads(cpus)

    @ember.method
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy decoding, without a KV cache: the whole sequence goes through each step."""
        if not prompt_ids or not all(isinstance(i, int) and 0 <= i < VOCAB for i in prompt_ids):
            raise ValueError(f"prompt_ids must be a non-empty list of token ids below {VOCAB}")
        if not 1 <= max_new_tokens <= CONTEXT - len(prompt_ids):
            raise ValueError(
                f"max_new_tokens must be 1 to {CONTEXT - len(prompt_ids)}: prompt and "
                f"generated tokens share a context of {CONTEXT}"
            )
        torch = self.torch
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        generated: list[int] = []
        began = time.perf_counter()
        with torch.no_grad():
            for _ in range(max_new_tokens):
                following = self.compiled(ids).argmax(dim=-1, keepdim=True)
                generated.append(int(following))
                ids = torch.cat([ids, following], dim=1)
        seconds = time.perf_counter() - began
        # Token ids, not text, in the log: enough to find a bad answer from the logs alone.
        print(f"generate: {len(prompt_ids)} prompt ids -> {generated} in {seconds:.3f} s")
        return {"tokens": generated}

    @ember.method
    def info(self) -> dict[str, Any]:
        """The model's size and how long its replica's first boot spent where."""
        return {
            "parameters": self.parameter_count,
            "weight_bytes": self.weight_bytes,
            "layers": LAYERS,
            "d_model": D_MODEL,
            "vocab": VOCAB,
            "torch": self.torch.__version__,
            "threads": self.torch.get_num_threads(),
            **self.boot,
        }
