"""bench/batch_online.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_batch_online_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 20 s: a server of its own, online calls alone for 6 s, then
    beside a batch of 1,000 requests) measures both phases and the batch's progress;
    what the ratio is is the bench's to report."""
    command = [sys.executable, "bench/batch_online.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result, result
    for phase in ("alone", "beside_batch"):
        assert result[phase]["calls"] > 10 and result[phase]["error_count"] == 0, result
        assert result[phase]["ttft_p99_s"] >= result[phase]["ttft_p50_s"] > 0
    assert result["beside_batch"]["batch_per_s"] > 0
    assert set(result["verdicts"]) == {"p99", "errors", "batch"}
    assert result["verdicts"]["errors"] and result["verdicts"]["batch"]
