"""bench/startup.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_startup_bench_runs_to_its_figures() -> None:
    """Its quick mode (about 6 s) starts `ember server` twice (a warm-up round, then one
    measured round: time to ready, time to stop, CPU of the server and its local worker)
    and times one `python -c "import ember"` as the baseline."""
    command = [sys.executable, "bench/startup.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result, result
    assert set(result["this"]) == {"ready", "stop", "cpu", "import ember"}, result
    for figure in result["this"].values():
        assert figure["median"] > 0, result
