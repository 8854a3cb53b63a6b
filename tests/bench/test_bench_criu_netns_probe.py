"""bench/criu_netns_probe.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from machine_needs import need, snapshot_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_criu_netns_probe_runs_to_its_checks() -> None:
    """Its quick mode (the probe itself, about 2 s) dumps a server holding TCP sockets in
    a network namespace of its own, restores it twice into fresh namespaces and checks
    each copy and the original: a new connection, the held connection, the same state."""
    if os.geteuid() != 0:
        need("root", "the probe makes network namespaces and runs CRIU")
    if problem := snapshot_problem():
        need("criu", problem)
    command = [sys.executable, "bench/criu_netns_probe.py", "--quick", "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert "failed" not in result, result
    assert result["dump_seconds"] > 0 and result["image_bytes"] > 0, result
    assert len(result["copies"]) == 2, result
    for checked in [result["original"], *result["copies"].values()]:
        assert set(checked["checks"]) == {"echo", "held connection", "same state", "replies"}
    assert result["ok"] is True, result
