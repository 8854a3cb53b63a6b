"""bench/failover.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_failover_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 25 s: a throwaway PostgreSQL, moto's S3, three control-plane
    processes and two workers of its own; one forwarding round of 100 calls through the
    owner and through a standby, then one kill -9 of the owner under load) measures every
    part and judges every reach; whether the platform is within them is the bench's."""
    command = [sys.executable, "bench/failover.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result
    forwarding = result["forwarding"]
    assert forwarding["owner"]["samples"] == forwarding["standby"]["samples"] == 100
    assert "added_p50_ms" in forwarding
    kills = result["kills"]
    assert kills["kills"] == 1
    assert all(len(values) == 1 for values in kills["recovery_s"].values())
    assert kills["spawned"] > 0 and "lost" in kills
    assert set(result["verdicts"]) == {"recovery", "lost", "forwarding"}
