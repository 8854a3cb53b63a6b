"""bench/gpu_health_check.py's dry run (what bench/gpu_checks.sh --dry-run runs on a
machine without a GPU): the worker's health watch over scripted NVML answers (the
fault-injection seam), one GPU healthy and one with XID 79."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_health_check_judges_scripted_gpus() -> None:
    command = [sys.executable, "bench/gpu_health_check.py", "--dry-run"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "GPU 0 (H100): healthy, in service (-)" in done.stdout
    assert done.stdout.count("GPU 1 (H100): failed, fenced (XID 79)") == 2
    assert "dry run: judged as scripted" in done.stdout
