"""User code that dies mid-input or cannot start gets a clear error and loses nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Platform

APP = "broken"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "broken.py", APP)


def test_replica_dying_mid_input_is_retried_then_fails_with_502(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        response = client.post(f"/{APP}--crashy/", json={})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "replica_lost"
    assert "2 attempts" in error["message"]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("unloadable", "RuntimeError: weights missing"),
        ("unready", "ConnectionError: database down"),
    ],
)
def test_replica_that_cannot_start_fails_the_input_with_the_reason(
    platform: Platform, deployed: dict[str, str], endpoint: str, expected: str
) -> None:
    with platform.client(timeout=120) as client:
        response = client.post(f"/{APP}--{endpoint}/run", json={})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "replica_start_failed"
    assert expected in error["message"]
    row = platform.endpoint_status(f"{APP}--{endpoint}")
    assert expected in row["last_startup_error"]
    logs = platform.ember("logs", f"{APP}/{endpoint}").stdout
    assert "Traceback" in logs and expected in logs
