"""bench/procs.py, the benchmarks' process helpers, checking itself as a script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_process_helpers_stop_what_left_the_servers_session() -> None:
    """Its quick mode (the same as its default, about 1 s) starts a server-like process
    whose child moved to a session of its own, finds the child, stops both and checks
    that neither is left running."""
    command = [sys.executable, "bench/procs.py", "--quick"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "found below the server: 1 process(es)" in done.stdout, output[-3000:]
    assert "0 left running: ok" in done.stdout, output[-3000:]
