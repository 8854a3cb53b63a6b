"""GPU state around CRIU snapshots: the CUDA driver's checkpoint API (driver 570 or newer).

CRIU cannot dump a process that holds GPU memory or maps NVIDIA device files. The CUDA
driver can empty such a process first: *lock* it (further CUDA calls block; work already
submitted finishes), *checkpoint* it (device memory is copied into host memory the driver
owns, and every GPU resource is released), and later *restore* it (GPUs re-acquired,
device memory copied back at the same virtual addresses, streams, contexts and captured
CUDA graphs valid again) and *unlock* it. Through `cuda-bindings` (`cuda.bindings.driver`):
`cuCheckpointProcessLock`, `…Checkpoint`, `…Restore`, `…Unlock`, `…GetState`,
`…GetRestoreThreadId`, the same driver functions the `cuda-checkpoint` utility calls.

The order the driver requires, and the one `dump.py` and `restore.py` follow:

    the original (dumped with leave_running):
        lock -> checkpoint -> [CRIU dump] -> restore -> unlock          (`checkpoint`, `resume`)
    a restored replica (its image holds the checkpointed state):
        [CRIU restore] -> restore -> unlock                             (`restore`)

A restore may put the device memory on other GPUs of the same chip than those it was
taken from, given (old UUID, new UUID) for each: `restore(pid, gpu_pairs)`, which needs
the restore arguments of cuda-bindings 13 and a CUDA 13 driver (`can_remap`). The agent
asks for it when a restored replica gets other GPUs than the snapshot's (`gpu_slots.py`).

Every call names the target by its PID as the caller sees it: the agent, outside the
replica's PID namespace (the replica is PID 1 inside; `ReplicaProcess.pid` and the PID
CRIU's restore answers are the outside ones). The target must be running, not stopped by
ptrace or a freezer, while these calls run: the work is done by a CUDA thread inside it
(the "restore thread"). That is why they wrap the CRIU dump and follow the CRIU restore
rather than run inside them. A restored process must find the same GPU model and driver
as the one that was dumped: both are in the snapshot key (`support.environment_key`).
Without GPU pairs, device memory comes back on the GPU it was taken from (by UUID),
which must have room.
CRIU's own CUDA plugin (`cuda_plugin.so`, when installed with `cuda-checkpoint` on PATH)
does the same work; every step here reads the process's state first and does only what
is left to do, so the two do not trip over each other.

What happens when a step fails (the platform then boots replicas cold):

- `uses_cuda` cannot tell (the driver has no CUDA state for the PID): the process is
  treated as a CPU process. `needs_checkpoint` refuses, before anything changes, to let a
  process that has NVIDIA device files open go to CRIU without a checkpoint: that dump
  could only fail, with a less helpful message.
- `checkpoint` fails (lock timeout: the driver leaves the process running; checkpoint
  error: it is left locked): the dump is not attempted; `resume` is still called, puts
  the original back to running, and the snapshot is reported failed. The replica serves.
- The CRIU dump fails: `resume` as above, the snapshot is reported failed.
- `resume` fails: the original's GPU state is lost or stuck (any CUDA call would block
  or fail), so it is killed; the control plane starts a replacement, which boots cold
  because a key whose snapshot failed is not tried again for a while.
- `restore` of a restored process fails: that process is killed and reaped, the restore
  is reported failed, and the replica boots cold instead.

Detection is automatic and cheap: `gpu_node()` and `driver_version()` read /dev and
/proc only. `cuda.bindings` is imported inside `CudaCheckpointer` alone, which `detect()`
creates only on a node with an NVIDIA GPU and driver 570 or newer: CPU-only machines never
import CUDA code. `cuda-bindings` is an optional dependency (`REQUIREMENT`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PROC = Path("/proc")
DEV = Path("/dev")
PROC_VERSION = PROC / "driver" / "nvidia" / "version"
SYS_VERSION = Path("/sys/module/nvidia/version")
MIN_DRIVER = (570, 0)
# What `pip install 'ember[gpu]'` installs. 12.x bindings run on every driver >= 570
# (cuda-bindings 13 needs a CUDA 13 driver, 580+); 12.8 is the first with these calls.
REQUIREMENT = "cuda-bindings>=12.8,<13"

LOCK_TIMEOUT_MS = 30_000  # at the quiet point nothing should be running on the GPU
CHECKPOINT_TIMEOUT = 180.0  # seconds; device memory to host memory, grows with its size
RESTORE_TIMEOUT = 120.0
CALL_TIMEOUT = 10.0  # get-state, unlock, and the lock's margin over its own timeout

# What a restore onto other GPUs needs from cuda-bindings (13 and newer).
REMAP_TYPES = ("CUcheckpointGpuPair", "CUcheckpointRestoreArgs")

# CUprocessState (cuda.h). Compared as ints, whatever enum type the bindings return.
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATE_NAMES = {RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}

REQUIRED_FUNCTIONS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "CUcheckpointLockArgs",
)


class CudaCheckpointError(Exception):
    """A checkpoint step failed. `call` is the driver function, `error` the CUDA error's
    name (e.g. "CUDA_ERROR_ILLEGAL_STATE") when the driver answered with one."""

    def __init__(
        self,
        message: str,
        *,
        call: str | None = None,
        error: str | None = None,
        pid: int | None = None,
    ) -> None:
        super().__init__(message)
        self.call = call
        self.error = error
        self.pid = pid


# ----- detection: no CUDA import ---------------------------------------------------
def gpu_node(dev: Path = DEV, proc_version: Path = PROC_VERSION) -> bool:
    """Whether this machine has an NVIDIA GPU: a /dev/nvidiaN device or the driver's
    /proc entry. Reads the file system only."""
    with contextlib.suppress(OSError):
        if proc_version.exists():
            return True
        return any(dev.glob("nvidia[0-9]*"))
    return False


_NVRM_VERSION = re.compile(r"\s(\d+)\.(\d+)(?:\.\d+)*(?=\s)")
_BARE_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.\d+)*")


def parse_driver_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64
    Kernel Module  570.86.15  …", the open module's "… Open Kernel Module for x86_64
    570.133.20  Release Build …") or /sys/module/nvidia/version ("570.86.15")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("NVRM version"):
            match = _NVRM_VERSION.search(line + " ")
            return (int(match.group(1)), int(match.group(2))) if match else None
    if len(lines) == 1:
        match = _BARE_VERSION.fullmatch(lines[0])
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def driver_version(path: Path | None = None) -> tuple[int, int] | None:
    """The NVIDIA kernel driver's version, read from `path`, else from /proc/driver/nvidia
    /version, then /sys/module/nvidia/version; None when unknown. No CUDA import."""
    for candidate in (path,) if path is not None else (PROC_VERSION, SYS_VERSION):
        try:
            text = candidate.read_text(errors="replace")
        except OSError:
            continue
        version = parse_driver_version(text)
        if version is not None:
            return version
    return None


def opens_nvidia_devices(pid: int, proc: Path = PROC) -> bool:
    """Whether process `pid` has an NVIDIA device file open or mapped (/dev/nvidia*)."""
    base = proc / str(pid)
    with contextlib.suppress(OSError):
        for fd in (base / "fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith("/dev/nvidia"):
                    return True
    with contextlib.suppress(OSError):
        return "/dev/nvidia" in (base / "maps").read_text(errors="replace")
    return False


def detect(
    *,
    dev: Path = DEV,
    proc_version: Path = PROC_VERSION,
    sys_version: Path = SYS_VERSION,
    driver: Any = None,
) -> tuple[CudaCheckpointer | None, str | None]:
    """(a checkpointer, None) on a GPU node that can checkpoint CUDA processes; (None, why
    not) on a GPU node that cannot; (None, None) on a machine without an NVIDIA GPU, which
    imports nothing. `driver` stands in for `cuda.bindings.driver` (tests)."""
    if not gpu_node(dev, proc_version):
        return None, None
    version = driver_version(proc_version) or driver_version(sys_version)
    if version is None:
        return None, f"the NVIDIA driver's version is unknown (no {proc_version})"
    if version < MIN_DRIVER:
        return None, (
            f"NVIDIA driver {version[0]}.{version[1]} is too old for the CUDA checkpoint "
            f"API; {MIN_DRIVER[0]} or newer is needed"
        )
    try:
        return CudaCheckpointer(driver), None
    except CudaCheckpointError as exc:
        return None, str(exc)


def _load_driver() -> Any:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise CudaCheckpointError(
            f"the optional package cuda-bindings is not installed ({exc}); install it with "
            f"pip install 'ember[gpu]' (that is, '{REQUIREMENT}')"
        ) from None


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, f"unknown ({state})")


def _write_uuid(target: Any, gpu_uuid: str) -> None:
    """Fill a CUuuid from nvidia-smi's "GPU-…" form. The bindings' CUuuid has a read-only
    `bytes`, so the 16 bytes go through its pointer."""
    raw = uuid.UUID(gpu_uuid.removeprefix("GPU-")).bytes
    ctypes.memmove(target.getPtr(), raw, len(raw))


# ----- the checkpointer --------------------------------------------------------------
class CudaCheckpointer:
    """The CUDA driver's checkpoint calls on other processes, each bounded in time.

    Calls are blocking (run them in a thread from async code). Each runs in a thread of
    its own and is waited for up to its timeout; one that does not return is reported as
    a `CudaCheckpointError`, and the process it targets takes no further call until it
    returns, since the driver's state for it is then unknown.
    """

    def __init__(
        self,
        driver: Any = None,
        *,
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
        checkpoint_timeout: float = CHECKPOINT_TIMEOUT,
        restore_timeout: float = RESTORE_TIMEOUT,
        call_timeout: float = CALL_TIMEOUT,
    ) -> None:
        self.driver = driver if driver is not None else _load_driver()
        missing = [name for name in REQUIRED_FUNCTIONS if not hasattr(self.driver, name)]
        if missing:
            raise CudaCheckpointError(
                f"this cuda-bindings has no {', '.join(missing)}; install '{REQUIREMENT}'"
            )
        self.lock_timeout_ms = lock_timeout_ms
        self.checkpoint_timeout = checkpoint_timeout
        self.restore_timeout = restore_timeout
        self.call_timeout = call_timeout
        self._guard = threading.Lock()
        self._busy: set[int] = set()  # PIDs with a driver call still running
        self._initialised = False

    # ----- what snapshots.py calls ----------------------------------------------------
    def uses_cuda(self, pid: int) -> bool:
        """Whether the driver holds CUDA state for `pid`. A process that never initialised
        CUDA gets an error from the driver (whichever): False. A call that does not return
        raises `CudaCheckpointError`."""
        try:
            self.state(pid)
        except CudaCheckpointError as exc:
            if exc.error is None:
                raise  # no answer from the driver at all: not a "no"
            return False
        return True

    def checkpoint(self, pid: int) -> float:
        """Lock `pid` (waiting at most `lock_timeout_ms`) and move its device memory to
        host memory: its CUDA state ends "checkpointed", ready for a CRIU dump. Returns the
        seconds it took. Whatever it raises, call `resume(pid)` afterwards."""
        began = time.monotonic()
        state = self.state(pid)
        if state == CHECKPOINTED:
            return 0.0  # someone (CRIU's CUDA plugin, say) already did it
        if state != RUNNING:
            raise CudaCheckpointError(
                f"process {pid}'s CUDA state is {state_name(state)}, not running: "
                "it cannot be checkpointed",
                call="cuCheckpointProcessGetState",
                pid=pid,
            )
        args = self.driver.CUcheckpointLockArgs()
        args.timeoutMs = self.lock_timeout_ms
        self._call(
            "cuCheckpointProcessLock",
            pid,
            args,
            timeout=self.lock_timeout_ms / 1000 + self.call_timeout,
        )
        self._call("cuCheckpointProcessCheckpoint", pid, None, timeout=self.checkpoint_timeout)
        return time.monotonic() - began

    def resume(self, pid: int) -> float:
        """Give the original process its GPU state back after the dump (which left it
        running): restore and unlock, from whatever state `checkpoint` left it in."""
        return self._to_running(pid)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> float:
        """Bring a process CRIU just restored from a CUDA-checkpointed image back to the
        GPU: restore and unlock. Raises when the driver has no CUDA state for `pid`.
        `gpu_pairs` (old UUID, new UUID), one for every GPU the image holds state of, puts
        that state on other GPUs of the same chip (`can_remap`)."""
        return self._to_running(pid, self._restore_args(gpu_pairs))

    @property
    def can_remap(self) -> bool:
        """Whether a restore can move device memory onto other GPUs: cuda-bindings 13
        with a CUDA 13 driver (580 or newer) have the restore's GPU pairs."""
        return all(hasattr(self.driver, name) for name in REMAP_TYPES)

    def _restore_args(self, gpu_pairs: Sequence[tuple[str, str]]) -> Any:
        if not gpu_pairs:
            return None
        if not self.can_remap:
            raise CudaCheckpointError(
                "putting GPU state on other GPUs at a restore needs cuda-bindings 13 and a "
                f"CUDA 13 driver (580+); this cuda-bindings has no {REMAP_TYPES[0]}",
                call="cuCheckpointProcessRestore",
            )
        entries = []
        for old, new in gpu_pairs:
            pair = self.driver.CUcheckpointGpuPair()
            _write_uuid(pair.oldUuid, old)
            _write_uuid(pair.newUuid, new)
            entries.append(pair)
        args = self.driver.CUcheckpointRestoreArgs()
        args.gpuPairs = entries
        args.gpuPairsCount = len(entries)
        return args

    # ----- the driver's calls ---------------------------------------------------------
    def state(self, pid: int) -> int:
        """`pid`'s CUprocessState as an int (see STATE_NAMES)."""
        (state,) = self._call("cuCheckpointProcessGetState", pid, timeout=self.call_timeout)
        value = _as_int(state)
        if value is None:
            raise CudaCheckpointError(
                f"cuCheckpointProcessGetState answered {state!r} for process {pid}",
                call="cuCheckpointProcessGetState",
                pid=pid,
            )
        return value

    def restore_thread_id(self, pid: int) -> int | None:
        """The thread in `pid` that does its checkpoint work (must not be stopped while
        a call runs), or None when the driver has none for it. For diagnostics."""
        if not hasattr(self.driver, "cuCheckpointProcessGetRestoreThreadId"):
            return None
        try:
            (tid,) = self._call(
                "cuCheckpointProcessGetRestoreThreadId", pid, timeout=self.call_timeout
            )
        except CudaCheckpointError as exc:
            if exc.error is None:
                raise
            return None
        return _as_int(tid)

    def _to_running(self, pid: int, restore_args: Any = None) -> float:
        began = time.monotonic()
        state = self.state(pid)
        if state == CHECKPOINTED:
            self._call(
                "cuCheckpointProcessRestore", pid, restore_args, timeout=self.restore_timeout
            )
            state = LOCKED
        if state == LOCKED:
            self._call("cuCheckpointProcessUnlock", pid, None, timeout=self.call_timeout)
            state = self.state(pid)
        if state != RUNNING:
            raise CudaCheckpointError(
                f"process {pid}'s CUDA state is {state_name(state)} after restore and unlock",
                call="cuCheckpointProcessGetState",
                pid=pid,
            )
        return time.monotonic() - began

    def _call(self, name: str, pid: int, *args: Any, timeout: float) -> tuple[Any, ...]:
        """Run driver function `name(pid, *args)` in a thread, at most `timeout` seconds;
        return what follows its CUresult, or raise `CudaCheckpointError` naming the error."""
        result = self._run(name, pid, args, timeout)
        error = self._error_name(result[0])
        if error == "CUDA_ERROR_NOT_INITIALIZED" and not self._initialised:
            self._init()  # this process never called cuInit: do it once, and try again
            result = self._run(name, pid, args, timeout)
            error = self._error_name(result[0])
        if error is not None:
            raise CudaCheckpointError(
                f"{name} failed for process {pid}: {error}", call=name, error=error, pid=pid
            )
        return tuple(result[1:])

    def _init(self) -> None:
        self._initialised = True
        init = getattr(self.driver, "cuInit", None)
        if init is not None:
            self._run("cuInit", 0, (), self.call_timeout, target=lambda: init(0))

    def _run(
        self,
        name: str,
        pid: int,
        args: tuple[Any, ...],
        timeout: float,
        target: Callable[[], Any] | None = None,
    ) -> tuple[Any, ...]:
        if target is None:
            function = getattr(self.driver, name, None)
            if function is None:
                raise CudaCheckpointError(
                    f"this cuda-bindings has no {name}; install '{REQUIREMENT}'",
                    call=name,
                    pid=pid,
                )

            def invoke() -> Any:
                return function(pid, *args)

            target = invoke
        call: Callable[[], Any] = target
        with self._guard:
            if pid in self._busy:
                raise CudaCheckpointError(
                    f"{name}: an earlier driver call on process {pid} has not returned",
                    call=name,
                    pid=pid,
                )
            self._busy.add(pid)
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["result"] = call()
            except BaseException as exc:  # handed to the caller below
                outcome["exception"] = exc
            finally:
                with self._guard:
                    self._busy.discard(pid)

        thread = threading.Thread(target=work, name=f"ember-{name}-{pid}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise CudaCheckpointError(
                f"{name} did not return within {timeout:g} s for process {pid}",
                call=name,
                pid=pid,
            )
        if "exception" in outcome:
            exc = outcome["exception"]
            raise CudaCheckpointError(
                f"{name} raised for process {pid}: {type(exc).__name__}: {exc}",
                call=name,
                pid=pid,
            ) from exc
        result = outcome.get("result")
        if not isinstance(result, tuple) or not result:
            raise CudaCheckpointError(
                f"{name} answered {result!r} for process {pid}", call=name, pid=pid
            )
        return result

    def _error_name(self, result: Any) -> str | None:
        """None for CUDA_SUCCESS, else the CUDA error's name."""
        code = _as_int(result)
        if code == 0:
            return None
        name = getattr(result, "name", None)
        if isinstance(name, str) and name:
            return name
        with contextlib.suppress(Exception):
            status, text = self.driver.cuGetErrorName(result)
            if _as_int(status) == 0 and text:
                return text.decode() if isinstance(text, bytes) else str(text)
        return f"CUresult {code if code is not None else result!r}"


def needs_checkpoint(
    checkpointer: CudaCheckpointer | None, problem: str | None, pid: int, proc: Path = PROC
) -> bool:
    """Whether `pid` must be CUDA-checkpointed before its CRIU dump. Raises
    `CudaCheckpointError` for a process that has NVIDIA devices open but cannot be
    checkpointed (no checkpointer on this node, or no CUDA state the driver knows): CRIU
    could not dump it either. Changes nothing."""
    if checkpointer is not None and checkpointer.uses_cuda(pid):
        return True
    if opens_nvidia_devices(pid, proc):
        if checkpointer is None:
            why = problem or "this node has no CUDA checkpointer"
        else:
            why = "the CUDA driver reports no checkpointable CUDA state for it"
        raise CudaCheckpointError(
            f"process {pid} uses the GPU but cannot be snapshotted: {why}", pid=pid
        )
    return False
