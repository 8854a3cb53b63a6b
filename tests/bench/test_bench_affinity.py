"""bench/affinity.py's quick mode runs to its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_affinity_bench_runs_to_its_figures() -> None:
    """Its quick mode (about 10 s: a server of its own, two replicas, 12 chats x 3 turns
    without keys, then the same with the session as the affinity key) measures both runs
    and their ratios; what the ratios are is the bench's to report."""
    command = [sys.executable, "bench/affinity.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    for run in ("plain", "keyed"):
        assert result[run]["calls"] == 12 * 3, result[run]
        for figure in ("reuse_rate", "p50_s", "p95_s", "p99_s", "calls_per_s"):
            assert figure in result[run]
    for ratio in ("p50_ratio", "p95_ratio", "throughput_ratio"):
        assert ratio in result
    assert "failed" not in result
