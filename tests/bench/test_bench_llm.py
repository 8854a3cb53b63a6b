"""bench/llm.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("batching", "lookup", "int8", "platform")


def test_the_llm_bench_runs_every_part_to_its_verdicts() -> None:
    """Its quick mode (about a minute and a half on 2 CPUs, SmolLM2-135M-Instruct converted
    from the package install.sh installs: 2 requests of 8 tokens through the Engine,
    transformers and model.generate; one attempt each way of prompt lookup; int8 against
    fp32 on 1 prompt x 8 tokens; a server of its own with the example deployed eager and
    without snapshots, 6 requests of 4 tokens through it and into an in-process Engine)
    measures every part and judges every reach; whether they pass is the bench's."""
    command = [sys.executable, "bench/llm.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert not [key for key in result if key.endswith("_error")], result
    batching = result["batching"]
    assert batching["requests"] == 2 and batching["new_tokens"] == 8
    assert set(batching["tokens_per_s"]) == {"transformers", "model_generate", "engine"}
    assert "engine_speedup" in result["lookup"] and "identical" in result["lookup"]
    assert result["int8"]["prompts"] == 1 and "ppl_int8" in result["int8"]
    platform = result["platform"]
    assert platform["platform"]["bench"]["requests"]["ok"] == 6
    assert platform["in_process"]["requests"] == 6
    assert set(platform["ttft_added_s"]) == {"p50", "p99"}
    assert set(result["verdicts"]) == {"batching_pass", "lookup_pass", "lookup_identical_pass"}
