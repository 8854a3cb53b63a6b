"""Which CRIU the worker runs, and what it says when that one cannot be run."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ember_worker.snapshots import support as snapshots
from ember_worker.snapshots.criu_calls import timeout_from_env

FAKE_CRIU = """#!/bin/sh
case "$1" in
    --version) echo "Version: 4.1.1" ;;
    check) exit 0 ;;
esac
"""


def _write(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_chosen_binary_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _write(tmp_path / "criu", FAKE_CRIU, stat.S_IRWXU)
    monkeypatch.setenv(snapshots.CRIU_BINARY_ENV, str(fake))
    assert snapshots._criu_binary() == str(fake)
    support = snapshots.detect_support(None)
    assert support.criu_binary == str(fake)
    assert support.criu_version == "4.1.1"


def test_a_chosen_binary_that_cannot_run_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_executable = _write(tmp_path / "criu", FAKE_CRIU, stat.S_IRUSR | stat.S_IWUSR)
    monkeypatch.setenv(snapshots.CRIU_BINARY_ENV, str(not_executable))
    support = snapshots.detect_support(None)
    assert support.criu_binary is None
    assert support.problem == (
        f"{snapshots.CRIU_BINARY_ENV}={not_executable} is not an executable file"
    )


def test_without_the_variable_the_usual_places_are_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(snapshots.CRIU_BINARY_ENV, raising=False)
    monkeypatch.setattr(snapshots, "CRIU_CANDIDATES", ())
    fake = _write(tmp_path / "criu", FAKE_CRIU, stat.S_IRWXU)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert snapshots._criu_binary() == str(fake)


def test_restores_are_lazy_only_when_asked_possible_and_free_of_gpu_state() -> None:
    lazy_kernel = snapshots.SnapshotSupport(None, "criu", "4.1.1", "env", lazy_pages=True)
    eager_kernel = snapshots.SnapshotSupport(None, "criu", "4.1.1", "env", lazy_pages=False)
    cpu_image: dict[str, object] = {"key": "k"}
    gpu_image: dict[str, object] = {"key": "k", "cuda": True}
    assert snapshots.restores_lazily(True, lazy_kernel, cpu_image)
    assert not snapshots.restores_lazily(False, lazy_kernel, cpu_image)
    assert not snapshots.restores_lazily(True, eager_kernel, cpu_image)
    # The driver copies GPU state back at once: no lazy restores of CUDA images.
    assert not snapshots.restores_lazily(True, lazy_kernel, gpu_image)


def test_criu_timeouts_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBER_TEST_TIMEOUT", raising=False)
    assert timeout_from_env("EMBER_TEST_TIMEOUT", 30.0) == 30.0
    monkeypatch.setenv("EMBER_TEST_TIMEOUT", " 2.5 ")
    assert timeout_from_env("EMBER_TEST_TIMEOUT", 30.0) == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("EMBER_TEST_TIMEOUT", bad)
        with pytest.raises(ValueError, match=r"EMBER_TEST_TIMEOUT=.* must be a positive number"):
            timeout_from_env("EMBER_TEST_TIMEOUT", 30.0)
