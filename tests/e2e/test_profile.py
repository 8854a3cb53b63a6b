"""`ember profile` (issue 37, item 7): py-spy, run by the worker's agent against a replica
busy in a Python loop, names that loop's function in the flame graph it writes and in a
`--dump`, a restored (CRIU) replica's too; a token that is not an admin's is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, wait_for
from machine_needs import need

import ember

APP = """
import time

import ember


def busy_python_loop(seconds: float) -> int:
    turns, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        turns += sum(range(200))
    return turns


@ember.endpoint(concurrency=2)
def spin(seconds: float) -> int:
    return busy_python_loop(seconds)


@ember.endpoint(name="snapped", scaledown_window=60)
class Snapped:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.table = list(range(1000))  # in the image

    @ember.method
    def spin(self, seconds: float) -> int:
        return busy_python_loop(seconds)
"""


@pytest.fixture(scope="module")
def busy(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A replica of spied--spin in its Python loop; its id."""
    folder = tmp_path_factory.mktemp("spied")
    (folder / "app.py").write_text(APP)
    platform.deploy(folder / "app.py", "spied")
    spin = ember.Endpoint.lookup("spied", "spin", config=platform.config())
    assert spin.call(seconds=0.01) > 0  # a replica up
    handle = spin.spawn(seconds=120)

    def running() -> Any:
        with platform.client() as client:
            replicas = client.get("/v1/replicas").json()["replicas"]
        return next((r["id"] for r in replicas if r["running"]), None)

    replica = wait_for(running, 60)
    yield replica
    handle.cancel()


def test_a_flame_graph_names_the_busy_function(
    platform: Platform, busy: str, tmp_path: Path
) -> None:
    out = tmp_path / "flame.svg"
    done = platform.ember("profile", "spied--spin", "--duration", "2", "-o", str(out))
    svg = out.read_text()
    assert svg.lstrip().startswith(("<?xml", "<svg")) and svg.rstrip().endswith("</svg>")
    assert "busy_python_loop" in svg, svg[:2000]
    assert "ember-profile-" not in svg  # the worker's temporary folder, in py-spy's title
    assert f"profiling replica {busy}" in done.stderr and f"wrote {out}" in done.stderr
    # speedscope, by -o's suffix, from the replica named.
    scope = tmp_path / "profile.json"
    platform.ember("profile", "spied--spin", "--replica", busy, "--duration", "1", "-o", str(scope))
    document = json.loads(scope.read_text())
    names = {frame["name"] for frame in document["shared"]["frames"]}
    assert "busy_python_loop" in names


def test_dump_prints_every_thread_once(platform: Platform, busy: str) -> None:
    dumped = platform.ember("profile", "spied--spin", "--dump").stdout
    assert "busy_python_loop" in dumped and "Thread " in dumped
    assert dumped.count("Thread ") >= 2  # the loop's and the replica's own


def test_only_an_admin_may_profile_and_labels_are_checked(platform: Platform, busy: str) -> None:
    for scope in ("invoke", "deploy"):
        token = platform.ember("token", "create", "--scope", scope).stdout.strip()
        with platform.client(token=token) as client:
            refused = client.post(f"/v1/replicas/{busy}/profile", json={"mode": "dump"})
        assert refused.status_code == 403, refused.text
    with platform.client() as client:
        bad = client.post(f"/v1/replicas/{busy}/profile", json={"mode": "rm -rf /"})
    assert bad.status_code == 400 and "mode is record or dump" in bad.text
    wrong = platform.ember("profile", "spied--spim", "--dump", check=False)
    assert wrong.returncode == 1 and "did you mean spied--spin?" in wrong.stderr


def _replicas(platform: Platform, label: str) -> list[dict[str, Any]]:
    with platform.client() as client:
        replicas = client.get("/v1/replicas").json()["replicas"]
    return [r for r in replicas if r["label"] == label]


def test_a_restored_replica_is_profiled_too(platform: Platform, busy: str) -> None:
    problem = platform.status()["workers"][0]["snapshots"].get("problem")
    if problem:
        need("criu", f"snapshots are off on this machine: {problem}")
    label = "spied--snapped"
    snapped = ember.Endpoint.lookup("spied", "snapped", config=platform.config())
    assert snapped.spin.call(seconds=0.01) > 0  # booted cold, then its snapshot taken
    wait_for(lambda: platform.endpoint_status(label)["snapshots"], 60)
    for replica in _replicas(platform, label):
        platform.ember("replica", "stop", replica["id"], "--now")
    handle = snapped.spin.spawn(seconds=120)
    try:
        restored = wait_for(
            lambda: [
                r
                for r in _replicas(platform, label)
                if r["running"] and r["start_kind"] == "restore"
            ],
            60,
        )
        dumped = platform.ember("profile", label, "--replica", restored[0]["id"], "--dump")
        assert "busy_python_loop" in dumped.stdout, dumped.stdout
    finally:
        handle.cancel()
