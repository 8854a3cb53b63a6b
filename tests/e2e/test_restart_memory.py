"""What a user reads after a restart of the control plane, and spawned calls in the
metrics (issue 37, item 5): `ember ls` still shows each endpoint's last start, the app's
log does not say "deployed version 1" again, and a spawned call is in
`ember:requests_total` and the latency histogram as kind async beside a sync call."""

from __future__ import annotations

from pathlib import Path

from harness import Platform, free_port, running_platform

import ember

APP = """
import ember

@ember.endpoint()
def twice(x: int) -> int:
    return 2 * x
"""


def _metric(platform: Platform, series: str) -> float:
    with platform.client() as client:
        text = client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _deployed_lines(platform: Platform) -> list[str]:
    logs = platform.ember("logs", "kept", "--tail", "1000").stdout
    return [line for line in logs.splitlines() if "deployed version" in line]


def test_a_restart_keeps_last_starts_and_spawned_calls_are_counted(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "app.py").write_text(APP)
    root, port = tmp_path / "platform", free_port()
    base = 'app="kept",endpoint="twice"'
    with running_platform(root, port=port) as platform:
        platform.deploy(tmp_path / "kept" / "app.py", "kept")
        twice = ember.Endpoint.lookup("kept", "twice", config=platform.config())
        assert twice.call(x=2) == 4
        assert twice.spawn(x=3).get(timeout=60) == 6
        for kind in ("sync", "async"):
            assert _metric(platform, f'ember:requests_total{{{base},kind="{kind}",status="200"}}')
            count = f'ember:e2e_request_latency_seconds_count{{{base},kind="{kind}"}}'
            assert _metric(platform, count) == 1.0
        assert _metric(platform, f'ember:request_queue_time_seconds_count{{{base},kind="async"}}')
        started = platform.endpoint_status("kept--twice")["last_start"]
        assert started["kind"] in ("cold", "restore") and started["total_seconds"] > 0
        assert len(_deployed_lines(platform)) == 1
    with running_platform(root, port=port) as platform:
        assert platform.endpoint_status("kept--twice")["last_start"] == started
        assert "last start: " in platform.ember("ls").stdout
        assert len(_deployed_lines(platform)) == 1
