"""A review of the node's own room check (`worker/ember_worker/agent/replicas/node_room.py`:
a node refuses a replica start past its --cpu/--memory, summed over the replicas it holds
records of) by a hostile tenant holding a deploy token of its own workspace, against a
real `ember server` and one worker. The tenant's replicas run its code and may pass file
descriptors to one another over a unix socket in a folder both see (here the test
session's shared folder; in production the node's copy of one of the app's
ember.Volume folders, which every replica of the app on the node mounts).

Found by this review: the agent kept a replica's record (and so its booking of the node's
CPUs and memory) until both its output pipes reached EOF, not until its process was
gone. A replica that handed its stdout and stderr to a sibling and then crashed was
forgotten by the control plane but stayed booked on the node for as long as the sibling
lived, and the node refused another tenant's replica for ever. Mended: a replica whose
process ended books nothing, and its output is read for at most 5 s after it ended.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import Platform, join_worker, running_platform, wait_for

LEAKY_APP = r'''
import os
import socket
import threading

import ember

SOCK = {sock!r}


@ember.endpoint(snapshot=False, min_replicas=1, max_replicas=1, cpu=0.25, scaledown_window=600)
class Keeper:
    """Holds whatever descriptors its siblings hand it, for as long as it lives."""

    @ember.enter()
    def listen(self) -> None:
        self.kept = []
        try:
            os.unlink(SOCK)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(SOCK)
        os.chmod(SOCK, 0o777)
        server.listen(8)

        def serve() -> None:
            while True:
                conn, _ = server.accept()
                _msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 8)
                self.kept.extend(fds)
                conn.sendall(b"k")
                conn.close()

        threading.Thread(target=serve, daemon=True).start()

    @ember.method
    def kept(self) -> int:
        return len(self.kept)


@ember.endpoint(snapshot=False, max_replicas=1, cpu=0.5, retries=0)
def leak() -> str:
    """Hands its stdout and stderr to the keeper, then dies."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCK)
    socket.send_fds(conn, [b"x"], [1, 2])
    conn.recv(1)
    os._exit(3)
'''

VICTIM_APP = """
import ember


@ember.endpoint(snapshot=False, max_replicas=1, cpu=0.5)
def victim() -> str:
    return "served"
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Platform, Path]]:
    root = tmp_path_factory.mktemp("node-room-review")
    with running_platform(root / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        node = root / "node-a"
        worker = join_worker(platform, token, node, "--cpu", "1", "--memory", "4096")
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 1, 60)
            yield platform, node.with_suffix(".log")
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()  # its stop waits for records a leaked pipe keeps
                worker.wait(timeout=30)


def _tenant(platform: Platform, workspace: str) -> str:
    platform.ember("workspace", "create", workspace)
    return platform.ember(
        "token", "create", "--workspace", workspace, "--scope", "deploy"
    ).stdout.strip()


def _deploy(platform: Platform, token: str, source: Path, name: str) -> None:
    done = platform.ember_as(token, "deploy", str(source), "--name", name, "--wait")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_crashed_replica_whose_pipes_a_sibling_holds_does_not_fill_the_node(
    platform: tuple[Platform, Path], tmp_path: Path, replica_writable: Path
) -> None:
    """The tenant's `leak` replica (0.5 CPU) hands its stdout and stderr to its `keeper`
    (0.25 CPU, kept running) and exits. Another tenant's replica of 0.5 CPU on the node
    of 1 CPU must then start and answer: the control plane counts 0.25 CPU taken, and so
    must the node (it failed before the mend: the node counted the dead replica's 0.5 as
    booked and refused every start of the other tenant's, which waited for ever)."""
    cp, worker_log = platform
    leaky = _tenant(cp, "leaky")
    quiet = _tenant(cp, "quiet")
    source = tmp_path / "leaky" / "app.py"
    source.parent.mkdir()
    source.write_text(LEAKY_APP.replace("{sock!r}", repr(str(replica_writable / "keeper.sock"))))
    other = tmp_path / "quiet" / "app.py"
    other.parent.mkdir()
    other.write_text(VICTIM_APP)
    _deploy(cp, leaky, source, "lk")
    _deploy(cp, quiet, other, "qt")
    try:
        wait_for(lambda: (replica_writable / "keeper.sock").exists(), 120)
        with cp.client(leaky, timeout=120) as client:
            crashed = client.post("/leaky--lk--leak/", json={})
        assert crashed.status_code >= 500, crashed.text  # its replica died mid-call
        # The control plane has forgotten the dead replica (its channel closed).
        wait_for(
            lambda: (
                sum(
                    sum(row.get("replicas", {}).values())
                    for row in cp.status()["endpoints"]
                    if row["label"] == "leaky--lk--leak"
                )
                == 0
            ),
            30,
        )
        began = time.monotonic()
        outcome = "answered"
        try:
            with cp.client(quiet, timeout=60) as client:
                answer = client.post("/quiet--qt--victim/", json={})
            if answer.status_code != 200:
                outcome = f"status {answer.status_code}: {answer.text[:200]}"
        except httpx.HTTPError as exc:
            outcome = f"{type(exc).__name__} after {time.monotonic() - began:.0f} s"
        refusals = [
            line for line in worker_log.read_text().splitlines() if "refused: the node's" in line
        ]
        assert outcome == "answered", (
            f"another tenant's call was not answered ({outcome}); the node refused its "
            f"replica {len(refusals)} times, the last: {refusals[-1:]}"
        )
    finally:
        cp.ember_as(leaky, "stop", "lk")  # the keeper ends, and the leaked pipes with it
