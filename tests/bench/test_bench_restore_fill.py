"""bench/restore_fill.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from machine_needs import need, snapshot_problem

from ember_worker.snapshots.huge_pages import huge_pages_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_restore_fill_bench_runs_to_its_figures() -> None:
    """Its quick mode (about 9 s) dumps a process holding 64 MB with CRIU, then restores
    the image 2 rounds each way, 0.2 s apart: as dumped (4 KiB pages) and from the view
    `ember worker --huge-pages` makes (2 MiB pages); p50 both ways and their ratio."""
    if problem := snapshot_problem():
        need("criu", problem)
    if problem := huge_pages_problem():
        need("huge-pages", problem)
    command = [sys.executable, "bench/restore_fill.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result, result
    assert result["image_bytes"] > 64e6, result
    assert [len(result["samples"][way]) for way in ("small", "huge")] == [2, 2], result
    assert set(result["p50_seconds"]) == {"small", "huge"}, result
    assert result["huge_over_small"] > 0, result
    assert isinstance(result["free_page_reporting"], bool), result
