"""bench/coldstart.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_coldstart_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 25 s: a server of its own with examples/transformer deployed
    twice, the model eager in the replicas; the first boot is snapshotted, then one round
    of a cold boot and a restore from zero replicas, 2 tokens each, and one timed
    page-cache read of the image) measures every part and judges every reach; whether the
    restore is within them is the bench's to report."""
    command = [sys.executable, "bench/coldstart.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result
    assert result["setup"]["compiled"] is False
    assert result["first_boot"]["seconds"] > 0
    assert sorted(sample["path"] for sample in result["samples"]) == ["cold", "restore"]
    image = result["image"]
    assert image["raw_bytes"] > 0 and len(image["page_cache_read_seconds"]) == 1
    for figure in ("cold_p50_s", "restore_p50_s", "ratio", "restore_step_s", "step_over_read"):
        assert figure in result["summary"]
    assert set(result["verdicts"]) == {"restore_ratio_pass", "page_cache_pass", "answers_pass"}
