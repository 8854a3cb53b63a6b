"""bench/async_calls.py's quick mode runs to its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_async_calls_bench_runs_to_its_figures() -> None:
    """Its quick mode (about 8 s: a server of its own, one round of 100 calls each way at
    1 and at 16 in flight) measures kept connections against a client per call at both
    loads, and their ratios; how large they are is the bench's to report."""
    command = [sys.executable, "bench/async_calls.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads(done.stdout)
    assert list(summary) == ["1", "16"]
    for row in summary.values():
        for side in ("kept", "fresh"):
            assert set(row[side]) == {"calls_per_s", "p50_ms"}
        assert "throughput_ratio" in row and "p50_ratio" in row
