"""Replicas over two nodes (gangs): two workers join one platform on this machine, each
replica in a sandbox and a network of its own; the gang's members find each other
through torchrun's variables and the gang's ports, rank 0 answers calls that every rank
works on (handed on by rank 0, or given to every rank where the endpoint says so), a
call that fails leaves the gang serving, a member killed brings a new gang up whole,
and a member that cannot reach its peers fails the gang's start, saying why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, join_worker, running_platform, wait_for

import ember


def members(platform: Platform, label: str) -> list[dict[str, Any]]:
    """A gang's members, by rank."""
    rows = json.loads(platform.ember("replica", "ls", "gang", "--json").stdout)
    return sorted((row for row in rows if row["label"] == label), key=lambda row: row["rank"])


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, apps_dir: Path) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("gangs")
    with running_platform(root / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        workers = [join_worker(platform, token, root / name) for name in ("node-a", "node-b")]
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 2, 60)
            platform.deploy(apps_dir / "gang.py", "gang")
            yield platform
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(timeout=60)


def test_a_gang_over_two_nodes_answers_and_comes_back_whole_when_a_member_dies(
    platform: Platform,
) -> None:
    pair = ember.Endpoint.lookup("gang", "pair", config=platform.config())
    answer = pair.total.call(value=2.0)
    assert answer["sum"] == 6.0  # 2 x 1 from rank 0, 2 x 2 from rank 1
    env = answer["env"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1"
    first, last = map(int, env["EMBER_GANG_PORTS"].split("-"))
    assert int(env["MASTER_PORT"]) == first and last == first + 15
    # In a network of its own, whose ephemeral ports are its gang ports (but the one it
    # listens on for its peers' rendezvous).
    assert answer["local_ports"] == [str(first + 1), str(last)]
    placed = members(platform, "gang--pair")
    assert [row["rank"] for row in placed] == [0, 1]
    assert len({row["gang"] for row in placed}) == 1
    assert {row["node"] for row in placed} == {"node-a", "node-b"}
    assert all(row["state"] == "ready" for row in placed)

    # A call that raises fails alone: the same gang serves the next.
    with pytest.raises(ember.RemoteError, match="this call fails; the gang serves on"):
        pair.fail.call()
    assert pair.total.call(value=1.0)["sum"] == 3.0
    assert [row["id"] for row in members(platform, "gang--pair")] == [r["id"] for r in placed]

    # Rank 1 killed: the gang goes whole, a new one starts and answers.
    platform.ember("replica", "stop", "--now", placed[1]["id"])
    assert pair.total.call(value=1.0)["sum"] == 3.0
    again = members(platform, "gang--pair")
    assert len(again) == 2 and {row["gang"] for row in again}.isdisjoint({placed[0]["gang"]})
    logs = platform.ember("logs", "gang", "--since", "1h").stdout
    assert f"rank 1 of its gang {placed[0]['gang']} was lost" in logs


def test_with_every_rank_each_member_runs_each_call_and_one_members_error_is_the_calls(
    platform: Platform,
) -> None:
    every = ember.Endpoint.lookup("gang", "every", config=platform.config())
    # 2 x 1 from rank 0 and 2 x 2 from rank 1, each from the value it was given itself.
    assert every.total.call(value=2.0) == {"sum": 6.0, "rank": 0}
    with pytest.raises(ember.RemoteError, match="rank 1 of its gang: rank 1 cannot"):
        every.fail_on_rank_1.call()
    # Rank 0's run of it was stopped: the same gang takes the next call at once.
    placed = [row["id"] for row in members(platform, "gang--every")]
    assert every.total.call(value=1.0)["sum"] == 3.0
    assert [row["id"] for row in members(platform, "gang--every")] == placed


def test_a_member_that_cannot_reach_its_peers_fails_the_gangs_start(platform: Platform) -> None:
    lonely = ember.Endpoint.lookup("gang", "lonely", config=platform.config())
    with pytest.raises(ember.RemoteError, match="replica_start_failed") as failed:
        lonely.ping.call()
    # The rendezvous' own words, rank 1's: nothing answered at its master's port (pasta
    # takes the connection in, but no process listens behind it), or it timed out.
    assert "fail to start: Dist" in str(failed.value), failed.value
    assert members(platform, "gang--lonely") == []  # nothing of the gang is left


TRIO = """
import ember


@ember.endpoint(nodes=3, cpu=0.5, memory=512, snapshot=False)
def trio() -> str:
    return "never"
"""


def test_a_gang_no_set_of_nodes_could_run_is_refused_at_deploy(
    platform: Platform, tmp_path: Path
) -> None:
    app = tmp_path / "trio.py"
    app.write_text(TRIO)
    done = platform.ember("deploy", str(app), "--name", "trio", check=False)
    assert done.returncode != 0, done.stdout
    assert "cannot_fit" in done.stderr, done.stderr
    assert "a gang of 3 members" in done.stderr and "join 1 more" in done.stderr, done.stderr
