"""Large results within a workspace's budget of bytes held in the control plane: past
it, its replicas' results wait in them until callers take theirs; every call still gets
its whole result, the control plane's memory stays near the budget, and /metrics shows
what each workspace holds. Another workspace's calls go on meanwhile."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from harness import Platform, running_platform

BUDGET_MIB = 48
RESULT_CHARS = 20_000_000
CALLERS = 8
APP = """\
import ember


@ember.endpoint(snapshot=False, concurrency=8, max_replicas=1, min_replicas=1)
def big(n: int) -> str:
    return "x" * n


@ember.endpoint(snapshot=False, min_replicas=1)
def noop() -> int:
    return 0
"""
HELD = re.compile(r'ember:held_bytes\{kind="answers",workspace="heavy"\} (\S+)')


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("held-bytes")
    budget = ("--workspace-held-mb", str(BUDGET_MIB))
    with running_platform(root / "platform", extra=budget) as platform:
        yield platform


def token_of(platform: Platform, workspace: str) -> str:
    platform.ember("workspace", "create", workspace)
    made = platform.ember("token", "create", "--workspace", workspace, "--scope", "deploy")
    return made.stdout.strip()


def test_large_results_past_the_budget_wait_and_all_arrive(
    platform: Platform, tmp_path: Path
) -> None:
    source = tmp_path / "app.py"
    source.write_text(APP)
    heavy, light = token_of(platform, "heavy"), token_of(platform, "light")
    for token in (heavy, light):
        deployed = platform.ember_as(token, "deploy", str(source), "--name", "res", "--wait")
        assert deployed.returncode == 0, deployed.stderr
    assert platform.process is not None
    server = platform.process.pid
    before = rss_bytes(server)

    answers: list[tuple[int, int]] = []

    def caller() -> None:
        with platform.client(heavy, timeout=180) as client:
            for _ in range(2):
                answer = client.post("/heavy--res--big/", json={"n": RESULT_CHARS})
                answers.append((answer.status_code, len(answer.content)))

    callers = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for thread in callers:
        thread.start()
    held_seen, peak, light_calls = 0.0, before, 0
    with platform.client() as admin, platform.client(light) as other:
        while any(thread.is_alive() for thread in callers):
            found = HELD.search(admin.get("/metrics").text)
            held_seen = max(held_seen, float(found[1]) if found else 0.0)
            answer = other.post("/light--res--noop/", json={})
            assert answer.status_code == 200 and answer.json() == 0, answer.text
            light_calls += 1
            peak = max(peak, rss_bytes(server))
            time.sleep(0.05)
    for thread in callers:
        thread.join()
    # Every call got its whole result (a JSON string: the characters and two quotes).
    assert answers == [(200, RESULT_CHARS + 2)] * CALLERS * 2, answers
    assert light_calls > 0
    # What was held never went past the budget by more than the one result that filled it
    # (the replica's channel is paused between whole results).
    assert 0 < held_seen <= BUDGET_MIB * 2**20 + RESULT_CHARS + 2, held_seen
    # 16 results of 20 MB went through; before the budget, the control plane held them
    # all at once, in several copies each.
    print(f"control plane: {before >> 20} MiB, at most {peak >> 20} MiB")
    assert peak - before < 200 * 2**20, (before, peak)
    with platform.client() as admin:
        metrics = admin.get("/metrics").text
    assert HELD.search(metrics) is None or float(HELD.search(metrics)[1]) == 0  # type: ignore[index]
