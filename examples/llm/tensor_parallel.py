"""SmolLM2-135M-Instruct split over the members of a gang: tensor parallelism with
torch.distributed (gloo on CPU, NCCL on GPUs), the same greedy tokens as one process.

A gang is one replica over several nodes (`nodes=`, docs/scaling.md): a process on each,
told its rank and its peers by torchrun's variables, so `init_process_group()` needs no
argument. Two worker nodes on one machine do (each node shows the converted model to its
sandboxes, as app.py's docstring says):

    python examples/llm/convert.py --out ~/.cache/ember/llm/smollm2
    ember server --no-worker
    for node in node-a node-b; do
        EMBER_LLM_DIR=~/.cache/ember/llm/smollm2 ember worker --server URL --name $node \
            --work-dir /var/lib/ember/$node --model-dir ~/.cache/ember/llm \
            --replica-env EMBER_LLM_DIR &
    done
    ember deploy examples/llm/tensor_parallel.py
    ember call tp--tensor-parallel/generate '{"prompt_ids": [1, 4093, 198], "max_new_tokens": 8}'

Each rank holds a share of every layer's attention heads (whole key/value heads, with the
query heads that read them) and of its MLP's features: the projections into them are cut
by output rows, the projections out of them by input columns, so each rank's output of
either is a partial sum, completed by an all-reduce (Megatron-LM's split). SmolLM2-135M's
3 key/value heads go 2 and 1 over two ranks. The embedding, the norms and the output head
are whole on every rank: after each all-reduce every rank holds the same states, so each
picks the same next token with nothing more exchanged. Rank 0 takes the calls and
broadcasts each request; the other ranks run the same steps in a thread of theirs, and a
rank whose steps fail ends its process, which ends the gang (a new one starts).

Each rank loads its share in `enter(snap=True)`, and forms its process group in
`enter()`: a snapshot of each rank is taken at its quiet point, and a new gang is
restored from them (on any nodes that fit), each member forming the group anew with its
new peers. `EMBER_TP_NODES` (read by `ember deploy`) sets the ranks (2 by default), at
most the model's key/value heads (3); with 1, the endpoint is an ordinary replica of the
whole model (bench/gang.py's baseline). `EMBER_LLM_SNAPSHOT=0` turns snapshots off.
`EMBER_TP_GPU=H100` gives each rank a GPU of that type: its share moves there after any
restore, and the ranks meet over NCCL (not run on this project's CPU machines).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ember

MODEL_DIR = Path(
    os.environ.get("EMBER_LLM_DIR", Path.home() / ".cache" / "ember" / "llm" / "smollm2")
)
NODES = int(os.environ.get("EMBER_TP_NODES", "2"))  # read by `ember deploy`
SNAPSHOT = os.environ.get("EMBER_LLM_SNAPSHOT", "1") != "0"  # likewise
GPU = os.environ.get("EMBER_TP_GPU") or None  # likewise: a GPU type for each rank, or none
END_OF_TURN = "<|im_end|>"
MAX_NEW_TOKENS = 256


def shares(count: int, ranks: int) -> list[range]:
    """`count` items cut into `ranks` runs in a row, the first ones a unit longer where
    they do not divide evenly."""
    size, extra = divmod(count, ranks)
    runs, start = [], 0
    for rank in range(ranks):
        end = start + size + (1 if rank < extra else 0)
        runs.append(range(start, end))
        start = end
    return runs


def shard(model: Any, rank: int, ranks: int) -> Any:
    """`model` (model.LlamaDecoder) cut down to rank `rank`'s share of `ranks`, in place."""
    import torch
    from torch import nn

    class AllReduced(nn.Module):
        """A projection out of a rank's share: its partial sums added over the ranks."""

        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x)
            torch.distributed.all_reduce(out)
            return out

    every = slice(None)

    def cut(linear: nn.Linear, rows: slice = every, columns: slice = every) -> nn.Linear:
        """A projection of `linear`'s weight's `rows` and `columns` alone."""
        weight = linear.weight[rows, columns].clone()
        part = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        part.weight = nn.Parameter(weight, requires_grad=False)
        return part

    config = model.config
    if ranks == 1:
        return model
    if ranks > config.num_key_value_heads:
        raise ValueError(
            f"{ranks} ranks, but the model has {config.num_key_value_heads} key/value heads "
            "to share: use at most that many"
        )
    group = config.num_attention_heads // config.num_key_value_heads  # query heads a kv head
    kv = shares(config.num_key_value_heads, ranks)[rank]
    features = shares(config.intermediate_size, ranks)[rank]
    d = config.head_dim
    queries = slice(kv.start * group * d, kv.stop * group * d)
    keys = slice(kv.start * d, kv.stop * d)
    mine = slice(features.start, features.stop)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.q_proj = cut(attention.q_proj, rows=queries)
        attention.k_proj = cut(attention.k_proj, rows=keys)
        attention.v_proj = cut(attention.v_proj, rows=keys)
        attention.o_proj = AllReduced(cut(attention.o_proj, columns=queries))
        attention.heads, attention.kv_heads = len(kv) * group, len(kv)
        mlp.gate_proj = cut(mlp.gate_proj, rows=mine)
        mlp.up_proj = cut(mlp.up_proj, rows=mine)
        mlp.down_proj = AllReduced(cut(mlp.down_proj, columns=mine))
    model.config = dataclasses.replace(  # the KV cache holds this rank's heads alone
        config,
        num_attention_heads=len(kv) * group,
        num_key_value_heads=len(kv),
        intermediate_size=len(features),
    )
    return model


@ember.endpoint(
    name="tensor-parallel",
    nodes=NODES,
    gpu=GPU,
    cpu=1.0,
    memory=2048,
    max_replicas=1,
    snapshot=SNAPSHOT,
    scaledown_window=300,
)
class TensorParallel:
    @ember.enter(snap=True)
    def load(self) -> None:
        """This rank's share of the model (RANK and WORLD_SIZE, as torchrun names them):
        in its snapshot, so a restored gang skips it."""
        sys.path.insert(0, str(Path(__file__).parent))  # model.py beside this file
        from model import load_model, tokenizer

        started = time.monotonic()
        rank, ranks = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.model = shard(load_model(MODEL_DIR), rank, ranks)
        self.stop_ids = {tokenizer(MODEL_DIR).token_to_id(END_OF_TURN)}
        self.lock = threading.Lock()  # one request through the ranks at a time
        self.load_seconds = time.monotonic() - started

    @ember.enter()
    def join(self) -> None:
        """The process group, formed after any restore (a snapshot holds no connection:
        a restored gang's peers are new, at new ports)."""
        import torch
        import torch.distributed as dist

        self.rank, self.ranks = 0, 1
        if torch.cuda.is_available():  # the node's GPU (gpu=, EMBER_TP_GPU): NCCL's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.model.to("cuda")
        if "WORLD_SIZE" not in os.environ:
            return  # one rank (EMBER_TP_NODES=1): an ordinary replica, no group
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        if self.rank != 0:
            threading.Thread(target=self.follow, daemon=True).start()

    def follow(self) -> None:
        """Rank 0's requests, run in step with it, for as long as this process lives."""
        try:
            while True:
                self.run(None)
        except BaseException as error:  # the gang cannot go on without this rank
            print(f"rank {self.rank} stops: {error!r}", file=sys.stderr, flush=True)
            os._exit(1)

    def run(self, request: dict[str, Any] | None) -> list[int]:
        """Rank 0's `request` (None on the others: theirs comes from rank 0), decoded."""
        import torch.distributed as dist

        box = [request]
        if self.ranks > 1:
            dist.broadcast_object_list(box, src=0)
        asked = box[0]
        assert asked is not None
        return list(
            self.model.generate(asked["prompt_ids"], asked["max_new_tokens"], self.stop_ids)
        )

    @ember.method()
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 16) -> dict[str, Any]:
        """Greedy token ids after `prompt_ids`, ending after the end-of-turn token."""
        if not prompt_ids or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"give prompt_ids, and max_new_tokens from 1 to {MAX_NEW_TOKENS}")
        with self.lock:
            started = time.monotonic()
            tokens = self.run({"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens})
            seconds = time.monotonic() - started
        return {
            "token_ids": tokens,
            "ranks": self.ranks,
            "seconds": round(seconds, 4),
            "load_seconds": round(self.load_seconds, 3),
        }
