"""examples/llm serving a model folder of its own (`EMBER_LLM_CONVERT=0`), as
bench/gpu_coldstart.py has it serve models of SmolLM2's larger shapes: the folder is used
as it is, `stats` says what was loaded and what graphs the replica made, and a folder
that lacks a file fails the replica's start with a message naming it."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform
from llm_example import EXAMPLE, example_module

import ember

NEEDED = ("tokenizers", "jinja2", "safetensors", "torch")
CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10_000.0,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(autouse=True, scope="module")
def _packages() -> None:
    if any(importlib.util.find_spec(name) is None for name in NEEDED):
        from machine_needs import need

        need("packages", "the LLM example's packages are missing (bash infra/install.sh --test)")


def write_model(folder: Path) -> int:
    """A tiny Llama of random weights in Hugging Face's layout; its parameter count."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_module = example_module("model")
    torch.manual_seed(0)
    model = model_module.LlamaDecoder(model_module.LlamaConfig.from_json(CONFIG))
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    vocab = {f"w{i}": i for i in range(CONFIG["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(
        "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    )
    (folder / "config.json").write_text(json.dumps(CONFIG))
    for path in folder.iterdir():
        path.chmod(0o644)  # the replicas' users read them
    return sum(tensor.numel() for tensor in state.values())


@pytest.fixture(scope="module")
def own_model(sandbox_shared: Path) -> Iterator[tuple[Path, int]]:
    # Where a sandboxed replica sees it: the folder every test worker shows its replicas.
    folder = sandbox_shared / "own-llm"
    folder.mkdir(mode=0o755)
    yield folder, write_model(folder)


@pytest.fixture(scope="module")
def platform(
    own_model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    env = {
        "EMBER_LLM_DIR": str(own_model[0]),
        "EMBER_LLM_CONVERT": "0",
        "EMBER_LLM_COMPILE": "0",  # eager: what is tested here is the folder, not compiling
        "EMBER_LLM_SNAPSHOT": "0",
        "EMBER_LLM_SCALEDOWN": "30",
    }
    with running_platform(tmp_path_factory.mktemp("llm-own"), env=env) as platform:
        yield platform


def test_a_folder_of_its_own_is_served_as_it_is(
    platform: Platform, own_model: tuple[Path, int]
) -> None:
    platform.deploy(EXAMPLE / "app.py", "own")
    llm = ember.Endpoint.lookup("own", "llm", config=platform.config())
    events = list(llm.generate.stream(prompt_ids=[1, 5, 9, 13], max_new_tokens=6))
    assert 1 <= len(events) <= 6
    assert all(0 <= event["token_id"] < CONFIG["vocab_size"] for event in events)
    stats = llm.stats.call()
    assert stats["model"]["device"] == "cpu"
    assert stats["model"]["parameters"] == own_model[1]
    assert stats["model"]["weight_bytes"] == own_model[1] * 4
    # The counts bench/gpu_coldstart.py reads are reported (all zero for this eager CPU
    # replica: graph_counts' own tests check that they count).
    counted = ("cuda_graph_captures", "compiled_graphs", "compile_cache_hits")
    assert {f"{name}{part}" for name in counted for part in ("", "_after_warm")} <= set(
        stats["graphs"]
    )
    # The chat path renders with the folder's template and tokenizer.
    answer = llm.method("chat_completions").call(
        messages=[{"role": "user", "content": "w5 w9"}], max_tokens=3
    )
    assert answer["usage"]["prompt_tokens"] == 2


def test_a_folder_lacking_a_file_fails_the_start_naming_it(
    platform: Platform, own_model: tuple[Path, int]
) -> None:
    tokenizer = own_model[0] / "tokenizer.json"
    tokenizer.rename(own_model[0] / "tokenizer.json.away")
    try:
        platform.deploy(EXAMPLE / "app.py", "lacking")
        with platform.client(timeout=300) as client:
            response = client.post("/lacking--llm/stats", json={})
        assert response.status_code == 500, response.text
        message = response.json()["error"]["message"]
        assert "EMBER_LLM_CONVERT=0" in message and "lacks tokenizer.json" in message, message
    finally:
        (own_model[0] / "tokenizer.json.away").rename(tokenizer)
