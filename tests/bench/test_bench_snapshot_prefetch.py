"""bench/snapshot_prefetch.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from machine_needs import need, snapshot_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_snapshot_prefetch_bench_runs_to_its_ratio() -> None:
    """Its quick mode (about 10 s) snapshots an endpoint holding 16 MB on one worker,
    drains it, and restores the image once on a second worker from the image it fetched
    ahead and once after downloading it: answer, fetch and restore times, ahead/download."""
    if problem := snapshot_problem():
        need("criu", problem)
    command = [sys.executable, "bench/snapshot_prefetch.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads(done.stdout)
    assert "failed" not in summary, summary
    assert summary["image_bytes"] > 0, summary
    for side in ("ahead", "download"):
        assert len(summary["rounds"][side]) == 1, summary
        assert set(summary["medians"][side]) == {"answer_s", "fetch_s", "restore_s"}, summary
    assert summary["ahead_over_download"] > 0, summary
