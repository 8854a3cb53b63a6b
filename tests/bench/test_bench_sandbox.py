"""bench/sandbox.py's quick mode, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from machine_needs import need, snapshot_problem

ROOT = Path(__file__).resolve().parents[2]


def test_the_sandbox_bench_runs_to_its_verdicts() -> None:
    """Its quick mode (about 20 s, 30 s on a busy machine) starts two platforms, with the
    sandbox and without it: one cold start and one restore from zero each, 5 warm calls
    each, and one 50 MB download each from the node's loopback port and from a network
    namespace behind a veth pair; every reach is judged."""
    if os.geteuid() != 0:
        need("root", "the bench runs sandboxed replicas and makes a network namespace")
    if problem := snapshot_problem():
        need("criu", problem)
    command = [sys.executable, "bench/sandbox.py", "--quick", "--json", "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads(done.stdout)
    assert "failed" not in summary, summary
    for side in ("on", "off"):
        assert summary["runs"][side]["kinds"] == ["restore"], summary
    assert set(summary["added_s"]) == {"cold", "restore", "call"}, summary
    assert set(summary["egress_ratios"]) == {"loopback", "outside"}, summary
    assert set(summary["within_reach"]) == {
        "cold",
        "restore",
        "call",
        "egress loopback",
        "egress outside",
    }, summary
