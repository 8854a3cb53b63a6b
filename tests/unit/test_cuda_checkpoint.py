"""GPU checkpointing around snapshots: detection without CUDA, and the order of the
driver's calls, checked against a fake driver that enforces the driver's state machine."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import uuid
from enum import IntEnum
from pathlib import Path
from typing import Any

import pytest

from ember_worker.snapshots import cuda_checkpoint
from ember_worker.snapshots.cuda_checkpoint import (
    CHECKPOINTED,
    LOCKED,
    RUNNING,
    CudaCheckpointer,
    CudaCheckpointError,
    detect,
    driver_version,
    gpu_node,
    needs_checkpoint,
    opens_nvidia_devices,
    parse_driver_version,
)

PROPRIETARY_570 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan 24 19:39:15 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)
OPEN_575 = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Sat May 24 07:21:40 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)
ARM_580 = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.65.06  Release Build  "
    "(dvs-builder@U22-I3-AF03-09-1)  Sun Jul 27 06:54:38 UTC 2025\n"
    "GCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n"
)
OLD_535 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


# ----- a fake cuda.bindings.driver ---------------------------------------------------
class FakeResult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909


class FakeState(IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class LockArgs:
    def __init__(self) -> None:
        self.timeoutMs = 0


class FakeDriver:
    """The driver's checkpoint state machine for the PIDs in `states`; every other PID
    never initialised CUDA. Records calls as (function, pid); answers like cuda-bindings:
    a tuple that starts with a FakeResult."""

    CUresult = FakeResult
    CUprocessState = FakeState
    CUcheckpointLockArgs = LockArgs

    def __init__(self, states: dict[int, int] | None = None) -> None:
        self.states = dict(states or {})
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: list[int] = []
        self.fail: dict[str, FakeResult] = {}  # function -> the error it answers once
        self.block: dict[str, threading.Event] = {}  # function -> wait for this first
        self.initialised = True

    def _enter(self, name: str, pid: int) -> FakeResult | None:
        self.calls.append((name, pid))
        if name in self.block:
            self.block[name].wait(10)
        if not self.initialised:
            return FakeResult.CUDA_ERROR_NOT_INITIALIZED
        if name in self.fail:
            return self.fail.pop(name)
        if pid not in self.states:
            return FakeResult.CUDA_ERROR_NOT_FOUND
        return None

    def _move(self, name: str, pid: int, before: int, after: int) -> tuple[FakeResult]:
        error = self._enter(name, pid)
        if error is not None:
            return (error,)
        if self.states[pid] != before:
            return (FakeResult.CUDA_ERROR_ILLEGAL_STATE,)
        self.states[pid] = after
        return (FakeResult.CUDA_SUCCESS,)

    def cuInit(self, flags: int) -> tuple[FakeResult]:
        self.calls.append(("cuInit", flags))
        self.initialised = True
        return (FakeResult.CUDA_SUCCESS,)

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[Any, ...]:
        error = self._enter("cuCheckpointProcessGetState", pid)
        if error is not None:
            return (error, FakeState.CU_PROCESS_STATE_RUNNING)
        return (FakeResult.CUDA_SUCCESS, FakeState(self.states[pid]))

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int) -> tuple[Any, ...]:
        error = self._enter("cuCheckpointProcessGetRestoreThreadId", pid)
        return (error, 0) if error is not None else (FakeResult.CUDA_SUCCESS, pid + 1)

    def cuCheckpointProcessLock(self, pid: int, args: LockArgs) -> tuple[FakeResult]:
        self.lock_timeouts.append(args.timeoutMs)
        return self._move("cuCheckpointProcessLock", pid, RUNNING, LOCKED)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: None) -> tuple[FakeResult]:
        assert args is None
        return self._move("cuCheckpointProcessCheckpoint", pid, LOCKED, CHECKPOINTED)

    def cuCheckpointProcessRestore(self, pid: int, args: None) -> tuple[FakeResult]:
        assert args is None
        return self._move("cuCheckpointProcessRestore", pid, CHECKPOINTED, LOCKED)

    def cuCheckpointProcessUnlock(self, pid: int, args: None) -> tuple[FakeResult]:
        assert args is None
        return self._move("cuCheckpointProcessUnlock", pid, LOCKED, RUNNING)

    def steps(self) -> list[str]:
        """The calls that change state, without the prefix, in order."""
        return [
            name.removeprefix("cuCheckpointProcess")
            for name, _ in self.calls
            if not name.startswith("cuCheckpointProcessGet")
        ]


PID = 4242


def checkpointer(driver: FakeDriver, **kwargs: Any) -> CudaCheckpointer:
    return CudaCheckpointer(driver, **kwargs)


# ----- detection ---------------------------------------------------------------------
NO_GPU_HERE = (
    not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/proc/driver/nvidia/version").exists()
)


def test_detection_on_this_machine_says_what_it_has() -> None:
    # Read from /dev and /proc, as the worker does: a CPU machine imports nothing of CUDA.
    assert gpu_node() is not NO_GPU_HERE
    if NO_GPU_HERE:
        assert driver_version() is None
        assert detect() == (None, None)
    else:
        assert driver_version() is not None


def test_gpu_node_from_device_or_proc_entry(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    version = tmp_path / "version"
    assert gpu_node(dev, version) is False
    (dev / "nvidiactl").touch()
    (dev / "nvidia-uvm").touch()
    assert gpu_node(dev, version) is False  # control devices alone are not a GPU
    (dev / "nvidia0").touch()
    assert gpu_node(dev, version) is True
    (dev / "nvidia0").unlink()
    version.write_text(PROPRIETARY_570)
    assert gpu_node(dev, version) is True


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PROPRIETARY_570, (570, 86)),
        (OPEN_575, (575, 57)),
        (ARM_580, (580, 65)),
        (OLD_535, (535, 183)),
        ("570.124.06\n", (570, 124)),  # /sys/module/nvidia/version
        ("", None),
        ("GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n", None),
        ("NVRM version: something unexpected\n", None),
    ],
)
def test_driver_version_parsing(text: str, expected: tuple[int, int] | None) -> None:
    assert parse_driver_version(text) == expected


def test_driver_version_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "version"
    assert driver_version(path) is None  # missing
    path.write_text(OPEN_575)
    assert driver_version(path) == (575, 57)


def _gpu_files(tmp_path: Path, version_text: str | None) -> dict[str, Path]:
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    (dev / "nvidia0").touch()
    proc_version = tmp_path / "proc-version"
    if version_text is not None:
        proc_version.write_text(version_text)
    return {"dev": dev, "proc_version": proc_version, "sys_version": tmp_path / "sys-version"}


def test_detect_refuses_old_or_unknown_drivers(tmp_path: Path) -> None:
    checkpointer_, problem = detect(**_gpu_files(tmp_path, OLD_535), driver=FakeDriver())
    assert checkpointer_ is None
    assert problem is not None and "535.183" in problem and "570" in problem
    (tmp_path / "proc-version").unlink()
    checkpointer_, problem = detect(**_gpu_files(tmp_path, None), driver=FakeDriver())
    assert checkpointer_ is None and problem is not None and "unknown" in problem


def test_detect_reads_sysfs_when_proc_has_no_version(tmp_path: Path) -> None:
    files = _gpu_files(tmp_path, None)
    files["sys_version"].write_text("570.86.15\n")
    found, problem = detect(**files, driver=FakeDriver())
    assert isinstance(found, CudaCheckpointer) and problem is None


def test_detect_makes_a_checkpointer_on_driver_570(tmp_path: Path) -> None:
    found, problem = detect(**_gpu_files(tmp_path, PROPRIETARY_570), driver=FakeDriver())
    assert isinstance(found, CudaCheckpointer)
    assert problem is None


def test_detect_says_how_to_install_cuda_bindings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As where cuda-bindings is not installed, whether it is here or not.
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    found, problem = detect(**_gpu_files(tmp_path, PROPRIETARY_570))
    assert found is None
    assert problem is not None
    assert "cuda-bindings" in problem and cuda_checkpoint.REQUIREMENT in problem


def test_bindings_without_the_checkpoint_api_are_refused() -> None:
    class OldDriver:
        CUresult = FakeResult

    with pytest.raises(CudaCheckpointError, match="cuCheckpointProcessLock"):
        CudaCheckpointer(OldDriver())


def test_importing_and_detecting_never_imports_cuda() -> None:
    code = (
        "import sys\n"
        "from ember_worker.snapshots import cuda_checkpoint as c\n"
        "c.gpu_node(); c.driver_version(); c.detect(); c.opens_nvidia_devices(1)\n"
        "loaded = sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded and not c.gpu_node() else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    if NO_GPU_HERE:
        assert result.stdout.strip() == "[]"


def test_opens_nvidia_devices_reads_fds_and_maps(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "7" / "fd").mkdir(parents=True)
    (proc / "7" / "maps").write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    os.symlink("/dev/null", proc / "7" / "fd" / "0")
    assert opens_nvidia_devices(7, proc) is False
    os.symlink("/dev/nvidiactl", proc / "7" / "fd" / "5")
    assert opens_nvidia_devices(7, proc) is True
    (proc / "8").mkdir()
    (proc / "8" / "maps").write_text("200000000-200200000 rw-s 00000000 00:05 9 /dev/nvidia0\n")
    assert opens_nvidia_devices(8, proc) is True
    assert opens_nvidia_devices(9, proc) is False  # no such process
    assert opens_nvidia_devices(os.getpid()) is False


# ----- the order of the driver's calls ------------------------------------------------
def test_a_process_without_cuda_is_not_a_cuda_process() -> None:
    driver = FakeDriver()
    cp = checkpointer(driver)
    assert cp.uses_cuda(PID) is False
    assert driver.steps() == []  # asking changes nothing


def test_original_process_lock_checkpoint_then_restore_unlock() -> None:
    driver = FakeDriver({PID: RUNNING})
    cp = checkpointer(driver, lock_timeout_ms=1234)
    assert cp.uses_cuda(PID) is True
    cp.checkpoint(PID)
    assert driver.states[PID] == CHECKPOINTED  # what CRIU dumps
    assert driver.steps() == ["Lock", "Checkpoint"]
    assert driver.lock_timeouts == [1234]
    cp.resume(PID)
    assert driver.states[PID] == RUNNING
    assert driver.steps() == ["Lock", "Checkpoint", "Restore", "Unlock"]
    assert all(pid == PID for _, pid in driver.calls)


def test_restored_process_restore_then_unlock() -> None:
    restored = 5151  # the restored replica's PID as the agent sees it
    driver = FakeDriver({restored: CHECKPOINTED})  # as the image holds it
    cp = checkpointer(driver)
    cp.restore(restored)
    assert driver.steps() == ["Restore", "Unlock"]
    assert driver.states[restored] == RUNNING
    assert {pid for _, pid in driver.calls} == {restored}


def test_restore_does_only_what_is_left() -> None:
    # CRIU's CUDA plugin may have restored (or restored and unlocked) it already.
    driver = FakeDriver({1: LOCKED, 2: RUNNING})
    cp = checkpointer(driver)
    cp.restore(1)
    cp.restore(2)
    assert driver.steps() == ["Unlock"]
    assert driver.states == {1: RUNNING, 2: RUNNING}


def test_restore_of_a_process_without_cuda_state_raises() -> None:
    cp = checkpointer(FakeDriver())
    with pytest.raises(CudaCheckpointError) as caught:
        cp.restore(PID)
    assert caught.value.error == "CUDA_ERROR_NOT_FOUND"
    assert caught.value.call == "cuCheckpointProcessGetState"


def test_lock_timeout_leaves_it_running_and_resume_is_a_no_op() -> None:
    driver = FakeDriver({PID: RUNNING})
    driver.fail["cuCheckpointProcessLock"] = FakeResult.CUDA_ERROR_TIMEOUT
    cp = checkpointer(driver)
    with pytest.raises(CudaCheckpointError) as caught:
        cp.checkpoint(PID)
    assert caught.value.call == "cuCheckpointProcessLock"
    assert caught.value.error == "CUDA_ERROR_TIMEOUT"
    assert "CUDA_ERROR_TIMEOUT" in str(caught.value) and str(PID) in str(caught.value)
    cp.resume(PID)
    assert driver.steps() == ["Lock"]
    assert driver.states[PID] == RUNNING


def test_failed_checkpoint_is_unlocked_by_resume() -> None:
    driver = FakeDriver({PID: RUNNING})
    driver.fail["cuCheckpointProcessCheckpoint"] = FakeResult.CUDA_ERROR_NOT_SUPPORTED
    cp = checkpointer(driver)
    with pytest.raises(CudaCheckpointError, match="CUDA_ERROR_NOT_SUPPORTED"):
        cp.checkpoint(PID)
    assert driver.states[PID] == LOCKED
    cp.resume(PID)
    assert driver.steps() == ["Lock", "Checkpoint", "Unlock"]
    assert driver.states[PID] == RUNNING


def test_failed_restore_is_reported_with_the_error_name() -> None:
    driver = FakeDriver({PID: CHECKPOINTED})
    driver.fail["cuCheckpointProcessRestore"] = FakeResult.CUDA_ERROR_INVALID_VALUE
    cp = checkpointer(driver)
    with pytest.raises(CudaCheckpointError) as caught:
        cp.restore(PID)
    assert caught.value.error == "CUDA_ERROR_INVALID_VALUE"
    assert caught.value.call == "cuCheckpointProcessRestore"
    assert caught.value.pid == PID
    assert driver.steps() == ["Restore"]  # never unlocked half-restored memory


def test_checkpoint_refuses_a_process_that_is_not_running() -> None:
    driver = FakeDriver({PID: LOCKED})
    cp = checkpointer(driver)
    with pytest.raises(CudaCheckpointError, match="locked, not running"):
        cp.checkpoint(PID)
    assert driver.steps() == []
    driver.states[PID] = CHECKPOINTED  # already done (CRIU's plugin): nothing to do
    cp.checkpoint(PID)
    assert driver.steps() == []


def test_not_initialised_caller_calls_cuinit_once_and_retries() -> None:
    driver = FakeDriver({PID: RUNNING})
    driver.initialised = False
    cp = checkpointer(driver)
    assert cp.uses_cuda(PID) is True
    assert [name for name, _ in driver.calls] == [
        "cuCheckpointProcessGetState",
        "cuInit",
        "cuCheckpointProcessGetState",
    ]
    cp.checkpoint(PID)
    assert [name for name, _ in driver.calls].count("cuInit") == 1


def test_unknown_error_codes_are_named_through_cugeterrorname() -> None:
    class Plain(FakeDriver):
        def cuGetErrorName(self, error: int) -> tuple[int, bytes]:
            return (0, b"CUDA_ERROR_SOMETHING_NEW")

        def cuCheckpointProcessGetState(self, pid: int) -> tuple[Any, ...]:
            return (999, 0)  # a plain int: no .name

    with pytest.raises(CudaCheckpointError) as caught:
        CudaCheckpointer(Plain()).state(PID)
    assert caught.value.error == "CUDA_ERROR_SOMETHING_NEW"


def test_an_exception_from_the_bindings_becomes_a_checkpoint_error() -> None:
    class Broken(FakeDriver):
        def cuCheckpointProcessGetState(self, pid: int) -> tuple[Any, ...]:
            raise RuntimeError("Function cuCheckpointProcessGetState not found")

    cp = CudaCheckpointer(Broken())
    with pytest.raises(CudaCheckpointError, match="not found") as caught:
        cp.uses_cuda(PID)  # not a "no": the driver never answered
    assert caught.value.error is None


def test_a_call_that_hangs_times_out_and_blocks_further_calls() -> None:
    driver = FakeDriver({PID: RUNNING})
    release = threading.Event()
    driver.block["cuCheckpointProcessCheckpoint"] = release
    cp = checkpointer(driver, checkpoint_timeout=0.1)
    try:
        with pytest.raises(CudaCheckpointError, match=r"did not return within 0\.1 s"):
            cp.checkpoint(PID)
        with pytest.raises(CudaCheckpointError, match="has not returned"):
            cp.resume(PID)  # the driver is still busy with this process
        assert cp.uses_cuda(4343) is False  # other processes are not held up
    finally:
        release.set()
    for _ in range(200):
        if PID not in cp._busy:
            break
        threading.Event().wait(0.01)
    cp.resume(PID)
    assert driver.states[PID] == RUNNING
    assert driver.steps() == ["Lock", "Checkpoint", "Restore", "Unlock"]


def test_restore_thread_id() -> None:
    cp = checkpointer(FakeDriver({PID: RUNNING}))
    assert cp.restore_thread_id(PID) == PID + 1
    assert cp.restore_thread_id(PID + 7) is None


# ----- the decision before a dump ----------------------------------------------------
def _proc_with(tmp_path: Path, pid: int, device: str | None) -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "maps").write_text("")
    if device:
        os.symlink(device, proc / str(pid) / "fd" / "9")
    return proc


def test_needs_checkpoint(tmp_path: Path) -> None:
    proc = _proc_with(tmp_path, PID, None)
    cp = checkpointer(FakeDriver({PID: RUNNING}))
    assert needs_checkpoint(cp, None, PID, proc) is True
    assert needs_checkpoint(checkpointer(FakeDriver()), None, PID, proc) is False
    assert needs_checkpoint(None, None, PID, proc) is False  # a CPU node, a CPU process


def test_needs_checkpoint_refuses_a_gpu_process_it_cannot_checkpoint(tmp_path: Path) -> None:
    proc = _proc_with(tmp_path, PID, "/dev/nvidia0")
    with pytest.raises(CudaCheckpointError, match="cuda-bindings is not installed"):
        needs_checkpoint(None, "cuda-bindings is not installed", PID, proc)
    with pytest.raises(CudaCheckpointError, match="no checkpointable CUDA state"):
        needs_checkpoint(checkpointer(FakeDriver()), None, PID, proc)


# ----- restoring onto other GPUs ---------------------------------------------------
class FakeUuid:
    """CUuuid as cuda-bindings 13 has it: read-only `bytes`, writable through getPtr()."""

    def __init__(self) -> None:
        self._raw = ctypes.create_string_buffer(16)

    def getPtr(self) -> int:
        return ctypes.addressof(self._raw)

    @property
    def bytes(self) -> bytes:
        return self._raw.raw


class FakeGpuPair:
    def __init__(self) -> None:
        self.oldUuid = FakeUuid()
        self.newUuid = FakeUuid()


class FakeRestoreArgs:
    def __init__(self) -> None:
        self.gpuPairs: list[FakeGpuPair] = []
        self.gpuPairsCount = 0


class RemappingDriver(FakeDriver):
    """A driver with cuda-bindings 13's restore arguments; keeps the pairs it was given."""

    CUcheckpointGpuPair = FakeGpuPair
    CUcheckpointRestoreArgs = FakeRestoreArgs

    def __init__(self, states: dict[int, int] | None = None) -> None:
        super().__init__(states)
        self.restored_pairs: list[tuple[bytes, bytes]] | None = None

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[FakeResult]:
        if args is not None:
            assert args.gpuPairsCount == len(args.gpuPairs)
            self.restored_pairs = [(p.oldUuid.bytes, p.newUuid.bytes) for p in args.gpuPairs]
        return self._move("cuCheckpointProcessRestore", pid, CHECKPOINTED, LOCKED)


OLD_GPU = "GPU-11111111-2222-3333-4444-555555555555"
NEW_GPU = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def test_a_restore_moves_gpu_state_onto_the_gpus_named() -> None:
    driver = RemappingDriver({PID: CHECKPOINTED})
    cuda = checkpointer(driver)
    assert cuda.can_remap
    cuda.restore(PID, [(OLD_GPU, NEW_GPU)])
    assert driver.states[PID] == RUNNING
    assert driver.restored_pairs == [(uuid.UUID(OLD_GPU[4:]).bytes, uuid.UUID(NEW_GPU[4:]).bytes)]


def test_a_restore_onto_the_same_gpus_passes_no_pairs() -> None:
    driver = RemappingDriver({PID: CHECKPOINTED})
    checkpointer(driver).restore(PID)
    assert driver.restored_pairs is None
    assert driver.states[PID] == RUNNING


def test_older_bindings_cannot_move_gpu_state() -> None:
    driver = FakeDriver({PID: CHECKPOINTED})
    cuda = checkpointer(driver)
    assert not cuda.can_remap
    with pytest.raises(CudaCheckpointError, match="cuda-bindings 13"):
        cuda.restore(PID, [(OLD_GPU, NEW_GPU)])
    assert driver.states[PID] == CHECKPOINTED  # nothing was called
