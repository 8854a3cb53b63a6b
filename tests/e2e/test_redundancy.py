"""Redundancy by default: an endpoint's replicas spread over zones (the nodes' `zone`
label) and nodes, so that losing a node leaves the others serving. Three workers join
(two in zone east, one in west); the west one is killed under load."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Platform, join_worker, running_platform, wait_for

import ember

# Named so that, zones aside, both replicas would land in east (the scheduler's last
# tie-break is the node's id, the largest first).
ZONES = {"node-a": "west", "node-b": "east", "node-c": "east"}
LABEL = "spread--served"


def replica_nodes(platform: Platform) -> list[str]:
    """The nodes of the endpoint's ready replicas."""
    rows = json.loads(platform.ember("replica", "ls", "spread", "--json").stdout)
    return sorted(row["node"] for row in rows if row["label"] == LABEL and row["state"] == "ready")


def unmount_left_under(folder: Path) -> None:
    """The scratch mounts a killed worker left (its next start would remove them)."""
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((p for p in points if p.startswith(f"{folder}/")), reverse=True):
        subprocess.run(["umount", "--lazy", point], check=False)


def test_replicas_spread_over_zones_and_a_lost_node_costs_callers_nothing(
    tmp_path: Path, apps_dir: Path
) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        workers = {
            name: join_worker(platform, token, tmp_path / name, "--label", f"zone={zone}")
            for name, zone in ZONES.items()
        }
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 3, 60)
            platform.deploy(apps_dir / "spread.py", "spread")
            served = ember.Endpoint.lookup("spread", "served", config=platform.config())
            assert wait_for(lambda: len(replica_nodes(platform)) == 2, 120)
            placed = replica_nodes(platform)
            # One in each zone: losing a zone (or a node) leaves one serving.
            assert sorted(ZONES[node] for node in placed) == ["east", "west"]
            (west,) = [node for node in placed if ZONES[node] == "west"]

            errors: list[BaseException] = []
            answered = 0

            def keep_calling(until: float) -> None:
                nonlocal answered
                while time.monotonic() < until:
                    try:
                        assert served.call(seconds=0.05) == 0.05
                        answered += 1
                    except Exception as error:  # every failure is the test's to report
                        errors.append(error)

            until = time.monotonic() + 8.0
            with ThreadPoolExecutor(max_workers=2) as pool:
                callers = [pool.submit(keep_calling, until) for _ in range(2)]
                time.sleep(1.5)
                workers[west].kill()  # the node goes at once, its replicas with it
                workers[west].wait(timeout=30)
                for caller in callers:
                    caller.result(timeout=60)
            assert not errors, errors[:3]
            assert answered > 20
            # Replaced on the nodes left, back to two.
            assert wait_for(lambda: len(replica_nodes(platform)) == 2, 120)
            assert west not in replica_nodes(platform)
        finally:
            for worker in workers.values():
                if worker.poll() is None:
                    worker.terminate()
                    worker.wait(timeout=30)
            unmount_left_under(tmp_path)
