"""A fault-injection seam: NVML's answers scripted by a test, for machines with no GPU.

When the worker's environment names a script (`EMBER_NVML_SCRIPT`, a JSON file), its GPU
health watch reads this instead of `pynvml`. The file is read again on every call, so a
test changes a GPU's condition while the worker runs:

    {"gpus": [{"xids": [79], "uncorrected_ecc": 0, "retirement_pending": false,
               "remap_failed": false, "clock_reasons": 0, "lost": false}]}

One entry per GPU, in index order; `xids` are the XID events so far (each is delivered
once). Only the calls `health.py` makes are answered. The variable is the operator's
(a worker's own environment, never a replica's): it is a test's, not a feature.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("ember.worker.gpu")

SCRIPT_ENV = "EMBER_NVML_SCRIPT"

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 0x8
_NOT_SUPPORTED, _TIMEOUT, _GPU_IS_LOST, _UNKNOWN = 3, 10, 15, 999


class NVMLError(Exception):
    def __init__(self, value: int, why: str = "") -> None:
        super().__init__(why or f"NVML error {value}")
        self.value = value


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass(frozen=True)
class _Event:
    device: _Handle
    eventData: int


_delivered: dict[int, int] = {}  # XID events handed out so far, by GPU index


def nvml_module() -> Any:
    """The NVML the worker's GPU health watch reads: this scripted one when the worker's
    environment names a script, else `pynvml` (ImportError where it is missing)."""
    if (path := script()) is not None:
        import sys

        log.warning(
            "GPU health reads the answers scripted in %s (%s), not the GPUs", path, SCRIPT_ENV
        )
        return sys.modules[__name__]
    import pynvml

    return pynvml


def script() -> Path | None:
    named = os.environ.get(SCRIPT_ENV)
    return Path(named) if named else None


def _gpus() -> list[dict[str, Any]]:
    path = script()
    if path is None:
        raise NVMLError(_NOT_SUPPORTED)
    # Only a script its own user (or root) may write is read: fences follow from it.
    about = path.stat()
    if about.st_uid not in (0, os.getuid()) or about.st_mode & 0o022:
        raise NVMLError(_UNKNOWN, f"{path} may be written by others than the worker's user")
    gpus: list[dict[str, Any]] = json.loads(path.read_text())["gpus"]
    return gpus


def _gpu(handle: _Handle) -> dict[str, Any]:
    gpus = _gpus()
    if handle.index >= len(gpus):
        raise NVMLError(_GPU_IS_LOST)
    gpu = gpus[handle.index]
    if gpu.get("lost"):
        raise NVMLError(_GPU_IS_LOST)
    return gpu


def nvmlInit() -> None:
    _gpus()


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    handle = _Handle(index)
    _gpu(handle)
    return handle


def nvmlDeviceGetHandleByUUID(uuid: str) -> _Handle:
    for index, gpu in enumerate(_gpus()):
        if gpu.get("uuid") == uuid:
            return nvmlDeviceGetHandleByIndex(index)
    raise NVMLError(_GPU_IS_LOST)


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    return str(_gpu(handle).get("uuid", f"GPU-scripted-{handle.index}"))


def nvmlEventSetCreate() -> list[_Handle]:
    return []


def nvmlDeviceRegisterEvents(handle: _Handle, kinds: int, events: list[_Handle]) -> None:
    events.append(handle)


def nvmlEventSetWait_v2(events: list[_Handle], timeout_ms: int) -> _Event:
    gpus = _gpus()
    for handle in events:
        xids = gpus[handle.index].get("xids", []) if handle.index < len(gpus) else []
        sent = _delivered.get(handle.index, 0)
        if sent < len(xids):
            _delivered[handle.index] = sent + 1
            return _Event(handle, int(xids[sent]))
    raise NVMLError(_TIMEOUT)


def nvmlDeviceGetTotalEccErrors(handle: _Handle, kind: int, counter: int) -> int:
    return int(_gpu(handle).get("uncorrected_ecc", 0))


def nvmlDeviceGetRetiredPagesPendingStatus(handle: _Handle) -> int:
    return int(bool(_gpu(handle).get("retirement_pending")))


def nvmlDeviceGetRemappedRows(handle: _Handle) -> tuple[int, int, int, int]:
    return (0, 0, 0, int(bool(_gpu(handle).get("remap_failed"))))


def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
    return int(_gpu(handle).get("clock_reasons", 0))
