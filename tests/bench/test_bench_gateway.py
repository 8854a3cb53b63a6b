"""bench/gateway.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gateway_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 15 s: a server of its own and the bare Starlette app, one
    round of each phase, 1 s windows) measures both targets at concurrency 1 and 32 and
    judges both reaches; whether the platform is within them is the bench's to report."""
    command = [sys.executable, "bench/gateway.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result
    assert result["setup"]["rounds"] == 1
    for target in ("bare", "platform"):
        figures = result["summary"][target]
        assert figures["c1_samples"] > 0
        for figure in ("c1_p50_ms", "c1_p99_ms", "rps", "c32_p50_ms", "cpu_us_per_request"):
            assert figure in figures
    for verdict in ("added_p50_pass", "throughput_pass"):
        assert isinstance(result["verdicts"][verdict], bool)
