"""tests/machine_needs.py: a test fails for what the machine lacks unless the run says the
machine may lack it, and infra/test.sh's snapshot check names what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import machine_needs
import pytest
from machine_needs import ALLOW_SKIP_ENV, need, snapshots_on

SCRIPT = Path(machine_needs.__file__)


def test_a_missing_need_fails_naming_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_SKIP_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match=f"{ALLOW_SKIP_ENV}=criu"):
        need("criu", "no CRIU")
    with pytest.raises(pytest.fail.Exception):
        snapshots_on("CRIU is not installed")
    assert snapshots_on(None) is True


def test_a_need_the_run_allows_lacking_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_SKIP_ENV, "cgroups, criu")
    with pytest.raises(pytest.skip.Exception):
        need("criu", "no CRIU")
    assert snapshots_on("CRIU is not installed") is False
    with pytest.raises(pytest.fail.Exception):
        need("root", "not root")


def test_gpus_may_be_lacking_by_default_and_unknown_names_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ALLOW_SKIP_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="allowed by default"):
        need("gpu", "no GPU")
    monkeypatch.setenv(ALLOW_SKIP_ENV, "crui")
    with pytest.raises(ValueError, match="crui"):
        need("criu", "no CRIU")


def test_the_snapshot_check_fails_naming_a_missing_criu(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        need("root", "the snapshot check runs only as root")
    env = {k: v for k, v in os.environ.items() if k != ALLOW_SKIP_ENV}
    env["EMBER_CRIU_BINARY"] = str(tmp_path / "no-criu")
    run = [sys.executable, str(SCRIPT)]
    failed = subprocess.run(run, env=env, capture_output=True, text=True, check=False)
    assert failed.returncode == 1
    assert "no-criu is not an executable file" in failed.stderr
    assert f"{ALLOW_SKIP_ENV}=criu" in failed.stderr
    allowed = {**env, ALLOW_SKIP_ENV: "criu"}
    passed = subprocess.run(run, env=allowed, capture_output=True, text=True, check=False)
    assert passed.returncode == 0, passed.stderr
