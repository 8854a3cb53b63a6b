"""bench/gang.py's quick mode, run as a user runs it: a cold gang of two ranks, then one
restored from its ranks' snapshots, each giving the tokens one rank gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from machine_needs import need, snapshot_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_gang_bench_runs_cold_then_restored_to_its_verdict(smollm2_dir: Path) -> None:
    if problem := snapshot_problem():
        need("criu", problem)
    command = [sys.executable, "bench/gang.py", "--quick", "--json", "--quiet"]
    command += ["--model-dir", str(smollm2_dir)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    figures = json.loads(done.stdout)
    assert "failed" not in figures, figures
    assert [r["kind"] for r in figures["rounds"]] == ["cold", "restore"], figures
    summary = figures["summary"]
    for figure in ("gang_restore_seconds", "gang_cold_start_seconds", "two_ranks_over_one"):
        assert summary[figure] > 0, figures
    assert set(figures["verdicts"]) == {"restore <= 15% of cold"}, figures
