"""bench/subprocess_spawn.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_subprocess_spawn_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 3 s) spawns one round of 50 children on each loop (Ember's,
    uvloop's, asyncio's), times spawn to exit and counts the children that ran Python
    before exec; none of Ember's may have."""
    command = [sys.executable, "bench/subprocess_spawn.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads(done.stdout)
    for loop in ("ember", "uvloop", "asyncio"):
        assert summary[loop]["children"] == 50, summary
        assert summary[loop]["p50_ms"] > 0, summary
    assert summary["ember"]["children_that_ran_python"] == 0, summary
    assert summary["ember_over_uvloop"] > 0, summary
    assert "failed" not in summary, summary
