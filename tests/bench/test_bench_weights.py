"""bench/weights.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = {"ember_cold", "boto3_then_load_file", "ember_warm", "load_file_local", "ember_http"}


def test_the_weights_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 20 s, 30 s on a busy machine: each trial is a fresh process
    that imports torch) loads a 0.12 GB safetensors file once by every path (Ember from
    moto's S3 and from nginx with an empty node cache, Ember with the cache filled,
    boto3's download then load_file, a local load_file) and judges every reach."""
    command = [sys.executable, "bench/weights.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result, result
    assert {kind for kind, samples in result["samples"].items() if len(samples) == 1} == PATHS
    summary = result["summary"]
    assert set(summary["p50_s"]) == PATHS, summary
    assert set(summary["verdicts"]) == {"cold", "warm", "first_tensor"}, summary
    assert set(summary["origin_requests"]) == {"ember_http", "ember_cold"}, summary
    assert all(count >= 1 for count in summary["origin_requests"].values()), summary
