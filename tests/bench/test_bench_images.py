"""bench/images.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_images_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 25 s: a small image, this node's python3.11 and the .venv's
    `packaging` as its pip layer; a node extracting it and a node mounting it lazily, one
    first start on each, one round of second starts, an unchanged redeploy) measures every
    part and judges every reach; whether the platform is within them is the bench's."""
    command = [sys.executable, "bench/images.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads(done.stdout)
    assert "failed" not in report
    assert report["image"]["requirement"].startswith("packaging==")
    assert report["image"]["inodes"] > 0
    for node in ("full", "lazy"):
        assert report[node]["seconds"] > 0 and report[node]["bytes_fetched"] > 0
    assert report["lazy"]["start"]["image_root"] == "lazy"
    assert len(report["second"]["rounds"]["lazy"]) == len(report["second"]["rounds"]["default"])
    assert "build_s" in report["redeploy"]
    assert set(report["ratios"]) == {"lazy_over_full", "second_over_default"}
    assert set(report["within_reach"]) == {"lazy_first_start", "second_start", "redeploy_build"}
