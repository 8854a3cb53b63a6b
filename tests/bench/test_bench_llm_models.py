"""bench/llm_models.py's quick mode runs to its verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_llm_models_check_runs_to_its_verdict() -> None:
    """Its quick mode (about 7 s: SmolLM2-135M's shape with 2 layers, random weights
    written to a temporary folder, loaded by examples/llm's decoder, 16 greedy tokens)
    times the write, the load and the decode and judges whether a token repeats."""
    command = [sys.executable, "bench/llm_models.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result
    (row,) = result["models"]
    assert (row["model"], row["layers"]) == ("135m", 2)
    assert row["weight_bytes"] > 0 and len(row["tokens"]) == 16
    for figure in ("write_seconds", "again_seconds", "load_seconds", "decode_seconds"):
        assert figure in row
    assert row["smallest_gap"] <= row["median_gap"]
    assert set(row["verdicts"]) == {"no_repeat"}
