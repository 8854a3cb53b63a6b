"""Which CRIU the worker runs, what it says when that one cannot be run, and how a CRIU
call in flight is ended."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from machine_needs import need

from ember_worker.snapshots import support as snapshots
from ember_worker.snapshots.criu_calls import CriuCall, descendants, timeout_from_env

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


STRAYING_SWRK = """#!/bin/sh
# Stands in for `criu swrk` mid-restore: a helper, and a task in a session of its own,
# both of which would wait forever once their parent is gone.
sleep 1000 &
setsid sleep 1000 &
exec sleep 1000
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_killing_a_criu_call_takes_every_process_swrk_forked_with_it(tmp_path: Path) -> None:
    try:
        import pycriu  # noqa: F401  (installed with CRIU: infra/criu.sh)
    except ImportError:
        need("criu", "pycriu is not installed")
    binary = tmp_path / "criu"
    binary.write_text(STRAYING_SWRK)
    binary.chmod(0o755)
    call = CriuCall(str(binary))
    channel = call.criu._comm
    channel.connect(False)
    swrk = channel.swrk
    assert swrk is not None
    deadline = time.monotonic() + 10
    while len(descendants(swrk)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    forked = descendants(swrk)
    assert len(forked) == 2 and all(_alive(pid) for pid in forked)
    assert call.kill() == 0  # nothing traced it
    channel.disconnect()  # reaps swrk
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in forked) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(_alive(pid) for pid in [swrk, *forked])
