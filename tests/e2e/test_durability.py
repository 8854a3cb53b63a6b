"""Async calls and their results survive a restart of the control plane."""

from __future__ import annotations

from pathlib import Path

from harness import free_port, running_platform

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
    # The control plane (and its worker and replicas) went away mid-call.
    with running_platform(root, port=port) as platform:
        assert ember.CallHandle(finished.call_id, config).get(timeout=10) == {"square": 9}
        assert ember.CallHandle(unfinished.call_id, config).get(timeout=60) == {"square": 49}
        assert "durable--slow-square" in platform.ember("ls").stdout
