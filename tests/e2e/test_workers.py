"""Worker nodes that join with `ember worker`, and a full queue."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import running_platform, wait_for

import ember


def test_joined_worker_serves_and_full_queue_gets_429(tmp_path: Path, apps_dir: Path) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker", "--max-queue", "2")) as platform:
        assert platform.status()["workers"] == []
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ember.cli.main",
                "worker",
                "--server",
                platform.url,
                "--token",
                token,
                "--ca-cert",
                platform.ca,
                "--work-dir",
                str(tmp_path / "node-b"),
                "--name",
                "node-b",
                "--cpu",
                "2",
            ],
            env=platform.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            assert platform.status()["workers"][0]["name"] == "node-b"
            platform.deploy(apps_dir / "scaling.py", "joined")
            single = ember.Endpoint.lookup("joined", "single", config=platform.config())
            assert single.call(seconds=0.01) == {"slept": 0.01}
            assert "bundles" in {p.name for p in (tmp_path / "node-b").iterdir()}
            # One replica, one input at a time, two may wait: the rest are turned away.
            with platform.client() as client, ThreadPoolExecutor(max_workers=6) as pool:
                responses = list(
                    pool.map(
                        lambda _: client.post("/joined--single/", json={"seconds": 1.0}),
                        range(6),
                    )
                )
            statuses = sorted(r.status_code for r in responses)
            assert statuses.count(200) >= 3 and 429 in statuses
            rejected = next(r for r in responses if r.status_code == 429)
            assert rejected.headers["retry-after"] == "1"
            assert rejected.json()["error"]["type"] == "queue_full"
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        # The worker left: its replicas are gone with it.
        wait_for(lambda: not platform.status()["workers"], 30)
