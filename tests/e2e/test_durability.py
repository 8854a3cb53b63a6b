"""Async calls and their results survive a restart of the control plane and a full disk."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import free_port, running_platform, wait_for
from machine_needs import need

import ember


def test_async_call_survives_control_plane_restart(tmp_path: Path, apps_dir: Path) -> None:
    root = tmp_path / "platform"
    port = free_port()
    with running_platform(root, port=port) as platform:
        platform.deploy(apps_dir / "durable.py", "durable")
        square = ember.Endpoint.lookup("durable", "slow-square", config=platform.config())
        finished = square.spawn(x=3, seconds=0.0)
        assert finished.get(timeout=60) == {"square": 9}
        unfinished = square.spawn(x=7, seconds=2.0)
        config = platform.config()
        platform.ember("scale", "durable--slow-square", "--max", "2")
        canary = ["deploy", str(apps_dir / "durable.py"), "--name", "durable", "--canary", "20"]
        platform.ember(*canary)
    # The control plane (and its worker and replicas) went away mid-call.
    with running_platform(root, port=port) as platform:
        assert ember.CallHandle(finished.call_id, config).get(timeout=10) == {"square": 9}
        assert ember.CallHandle(unfinished.call_id, config).get(timeout=60) == {"square": 49}
        assert "durable--slow-square" in platform.ember("ls").stdout
        # `ember scale`'s change holds across the restart, for the version it was set on.
        scaled = platform.ember("scale", "durable--slow-square").stdout
        assert "max_replicas      2  (deployed: 4)" in scaled
        # So does a canary, with its share.
        assert (
            "canary version 2 takes 20% of the calls" in platform.ember("canary", "durable").stdout
        )


def test_a_wait_on_a_spawned_call_outlasts_a_restart_of_the_server(
    tmp_path: Path, apps_dir: Path
) -> None:
    root = tmp_path / "platform"
    port = free_port()
    results: list[object] = []
    with running_platform(root, port=port) as platform:
        platform.deploy(apps_dir / "durable.py", "durable")
        config = platform.config()
        square = ember.Endpoint.lookup("durable", "slow-square", config=config)
        call = square.spawn(x=5, seconds=3.0)

        def wait() -> None:
            try:
                results.append(call.get(timeout=120))
            except Exception as exc:  # what it raised is what the test checks
                results.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        wait_for(lambda: platform.endpoint_status("durable--slow-square")["running"] == 1, 60)
        platform.stop(signal.SIGKILL)  # mid-call, mid-wait
    time.sleep(2)  # down for a moment: the wait asks again meanwhile
    assert not results, results
    with running_platform(root, port=port):
        waiter.join(90)
    assert results == [{"square": 25}]
    with pytest.raises(ember.InvalidError, match="timeout is seconds"):
        call.get(timeout=float("nan"))


def _fill(folder: Path) -> Path:
    """Take every free byte of the filesystem under `folder`; returns the file to delete."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096, b"\0"):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def small_state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state dir on a filesystem of its own, small enough to fill."""
    if os.geteuid() != 0:
        need("root", "mounting a small filesystem needs root")
    state = tmp_path / "platform" / "state"
    state.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=128m,mode=0700", "tmpfs", str(state)]
    mounted = subprocess.run(mount, capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        need("root", f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield state
    finally:
        subprocess.run(["umount", "--lazy", str(state)], check=False)


def test_a_full_disk_refuses_what_it_cannot_record_and_loses_no_result(
    small_state_dir: Path, apps_dir: Path
) -> None:
    root = small_state_dir.parent
    port = free_port()
    with running_platform(root, port=port) as platform:
        platform.deploy(apps_dir / "durable.py", "durable")
        config = platform.config()
        square = ember.Endpoint.lookup("durable", "slow-square", config=config)
        assert square.call(x=2, seconds=0.0) == {"square": 4}
        # The first replica's snapshot is stored before the disk fills.
        wait_for(lambda: " stored (" in platform.ember("logs", "durable").stdout, 60)
        accepted = square.spawn(x=3, seconds=4.0)
        filler = _fill(small_state_dir)

        # What the control plane cannot record it refuses, clearly, and changes nothing.
        with pytest.raises(ember.RemoteError) as refused:
            square.spawn(x=5, seconds=0.0, padding="x" * (6 << 20))  # more than the WAL holds
        assert (refused.value.status, refused.value.error_type) == (507, "insufficient_storage")
        assert "retry once" in refused.value.message
        deploy = platform.ember(
            "deploy", str(apps_dir / "basic.py"), "--name", "later", check=False
        )
        assert deploy.returncode != 0
        assert "insufficient_storage (507)" in deploy.stderr
        assert "No space left on device" in deploy.stderr
        # The call accepted before still ends, and its result is there; calls go on.
        assert ember.CallHandle(accepted.call_id, config).get(timeout=60) == {"square": 9}
        assert square.call(x=4, seconds=0.0) == {"square": 16}
        assert "later--echo" not in platform.ember("ls").stdout

        filler.unlink()
        assert square.spawn(x=6, seconds=0.0).get(timeout=60) == {"square": 36}
        platform.deploy(apps_dir / "basic.py", "later")
    # Whatever was held in memory while the disk was full reached the store.
    with running_platform(root, port=port):
        assert ember.CallHandle(accepted.call_id, config).get(timeout=10) == {"square": 9}
