"""bench/volumes.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_volumes_bench_runs_to_its_ratios() -> None:
    """Its quick mode (about 3 s) moves one 16 MB file up and down and 20 files of 64 KB
    up, one round each through `ember.Volume` (`ember server --no-worker`) and through a
    bare HTTPS file server: MB/s, files/s and platform/bare of each."""
    command = [sys.executable, "bench/volumes.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = json.loads(done.stdout)
    assert "failed" not in rows, rows
    figures = {"upload_mb_s", "download_mb_s", "small_files_s"}
    for side in ("platform", "bare", "ratio"):
        assert set(rows[side]) == figures, rows
        assert all(value > 0 for value in rows[side].values()), rows
