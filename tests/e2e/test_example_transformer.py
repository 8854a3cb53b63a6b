"""examples/transformer deployed as its README says: a compiled 108 M-parameter decoder,
its first replica booted cold, then one restored from its snapshot answering the same
tokens without compiling again; the README's `ember call` lines run as written."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from documented_commands import run_documented, running_reader_platform
from harness import replicas_ready, wait_for
from machine_needs import need, snapshots_on

import ember

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformer" / "app.py"
APP = "transformer"
# Embeddings (32,000 x 1,024 and 128 x 1,024), six blocks of 12,587,008 (two norms, qkv,
# out, up, down), the final norm: the README's "108 M parameters".
PARAMETERS = 32_000 * 1024 + 128 * 1024 + 6 * 12_587_008 + 2 * 1024
PROMPT = [1, 2, 3, 4]


def answered(out: str, key: str, expected: object) -> None:
    assert json.loads(out)[key] == expected, out


def test_transformer_example_answers_alike_cold_and_restored(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        need("packages", "torch is missing (bash infra/install.sh --test)")
    with running_reader_platform(tmp_path / "platform") as platform:
        platform.deploy(EXAMPLE, APP)
        lm = ember.Endpoint.lookup(APP, "lm", config=platform.config())
        cold = lm.generate.call(prompt_ids=PROMPT, max_new_tokens=8)["tokens"]
        assert len(cold) == 8 and all(0 <= token < 32_000 for token in cold)
        info = lm.info.call()
        assert info["parameters"] == PARAMETERS
        assert info["weight_bytes"] == 4 * PARAMETERS  # fp32
        assert info["compile_seconds"] > 0 and info["torch"].startswith("2.")
        # Greedy decoding of seeded weights: the same tokens every time, also from the
        # README's commands (its call has the same prompt and length).
        assert lm.generate.call(prompt_ids=PROMPT, max_new_tokens=8)["tokens"] == cold
        checks = {
            "ember call transformer--lm/generate ": lambda out: answered(out, "tokens", cold),
            "ember call transformer--lm/info ": lambda out: answered(out, "parameters", PARAMETERS),
        }
        run_documented("transformer", platform, checks, tmp_path)
        with pytest.raises(ember.UserCodeError, match="max_new_tokens must be 1 to 124"):
            lm.generate.call(prompt_ids=PROMPT, max_new_tokens=500)
        with pytest.raises(ember.UserCodeError, match="prompt_ids must be"):
            lm.generate.call(prompt_ids=[-1])

        problem = platform.status()["workers"][0]["snapshots"].get("problem")
        if not snapshots_on(problem):
            return  # EMBER_TEST_ALLOW_SKIP names criu: the cold path is all that ran
        wait_for(lambda: platform.endpoint_status(f"{APP}--lm")["snapshots"], 180)
        # A second replica (concurrency 1: one call each) restores from the image.
        with replicas_ready(platform, lm, 2), ThreadPoolExecutor(max_workers=2) as pool:
            both = list(
                pool.map(
                    lambda _: lm.generate.call(prompt_ids=PROMPT, max_new_tokens=8)["tokens"],
                    range(2),
                )
            )
        assert both == [cold, cold]
        logs = platform.ember("logs", APP, "-n", "500").stdout
        assert "restored from a snapshot" in logs
        # Compiled once, before the snapshot: the restored replica never printed it again.
        assert logs.count("model ready:") == 1, logs
