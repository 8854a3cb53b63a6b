"""bench/scaleout.py's quick mode runs to its verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_scaleout_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 30 s: a throwaway PostgreSQL, moto's S3, one worker, two
    apps, and one, two, then three control-plane processes each held to half a CPU)
    measures calls/s, streamed events/s and CPU per call at each count, the P50 added
    through a process that does not serve the app, and a kill -9 of the serving process
    under spawned calls; whether the platform is within the
    reaches is the bench's."""
    command = [sys.executable, "bench/scaleout.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result
    counts = result["counts"]
    assert [row["processes"] for row in counts] == [1, 2, 3]
    for row in counts:
        assert row["calls_per_s"] > 0 and row["events_per_s"] > 0
        assert len(row["cpu_us_per_call"]) == row["processes"]
        assert all(us > 0 for us in row["cpu_us_per_call"])
    assert "through_other_added_p50_ms" in counts[1] and "through_other_added_p50_ms" in counts[2]
    kill = result["kill"]
    assert kill["spawned"] > 0 and "lost" in kill and kill["answered_max_s"] > 0
    assert set(result["verdicts"]) == {"calls", "events", "through_other", "kill"}
    assert all(verdict is not None for verdict in result["verdicts"].values())
