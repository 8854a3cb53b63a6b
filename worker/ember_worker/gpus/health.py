"""Each GPU's health, watched through NVML (`nvidia-ml-py`): a GPU with a fatal condition
is fenced (no replica is placed on it) until the operator uncordons it.

Fatal: a critical XID event (48 double-bit ECC, 63/64 page retirement or row remapping,
74 NVLink, 79 fallen off the bus, 94/95 contained or uncontained ECC, ...), double-bit
(uncorrected) ECC errors, pages pending retirement, a row remapping failure, or the GPU
lost from the bus (NVML says so of any read). Degraded, not fenced: a thermal or power
slowdown of its clocks. Unknown: no NVML on the node (said once in the log), or a GPU
NVML does not list; never "healthy" for want of a reading.

`assess` is the pure judgement of one reading; `GpuHealthWatch` reads NVML and keeps the
fences. The NVML it reads is passed in (`nvml_module`): the real one, or, in tests, the
scripted one of `scripted_nvml.py` (these machines have no GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.wire import messages as wire
from ember_worker.resources import GpuDevice

log = logging.getLogger("ember.worker.gpu")

# XIDs that mean the GPU can no longer be trusted with a replica (NVIDIA's XID catalogue:
# memory errors, page retirement and row remapping, NVLink, bus loss, GSP and ECC faults).
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140})
# Clock event reasons (nvmlClocksEventReason*) that mean a thermal or power slowdown.
SLOWDOWNS = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "power brake slowdown",
}
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
EVENTS_SECONDS = 0.05  # XID events drained per check: a storm waits for the next


@dataclass(frozen=True)
class GpuReading:
    """What NVML said of one GPU in one check."""

    lost: bool = False
    xids: tuple[int, ...] = ()  # events since the last check
    uncorrected_ecc: int = 0  # volatile double-bit ECC errors
    retirement_pending: bool = False
    remap_failed: bool = False
    clock_reasons: int = 0


def assess(reading: GpuReading) -> tuple[str, list[str]]:
    """The GPU's state (failed, degraded or healthy) and why."""
    if reading.lost:
        return "failed", ["lost from the bus"]
    fatal = [f"XID {xid}" for xid in reading.xids if xid in CRITICAL_XIDS]
    if reading.uncorrected_ecc > 0:
        fatal.append(f"{reading.uncorrected_ecc} double-bit ECC errors")
    if reading.retirement_pending:
        fatal.append("pages pending retirement")
    if reading.remap_failed:
        fatal.append("row remapping failed")
    if fatal:
        return "failed", fatal
    slow = [name for bit, name in SLOWDOWNS.items() if reading.clock_reasons & bit]
    return ("degraded", slow) if slow else ("healthy", [])


@dataclass
class _Fence:
    reasons: list[str]
    lost: bool


@dataclass
class GpuHealthWatch:
    devices: Sequence[GpuDevice]
    # The NVML module, imported (and initialised) on first use; None: the node has none.
    nvml_module: Callable[[], Any]
    fences: dict[int, _Fence] = field(default_factory=dict)  # by device index
    _nvml: Any = field(default=None, init=False)
    _events: Any = field(default=None, init=False)
    _problem: str | None = field(default=None, init=False)
    _started: bool = field(default=False, init=False)
    _uuids: dict[str, int] = field(default_factory=dict, init=False)  # an event's device
    _last_failure: str | None = field(default=None, init=False)

    def fenced(self) -> set[int]:
        return set(self.fences)

    def uncordon(self, index: int) -> bool:
        """The GPU takes replicas again (the next check fences it anew if it still
        fails); False if it was not fenced."""
        return self.fences.pop(index, None) is not None

    def check(self, holders: Mapping[int, list[str]]) -> list[wire.GpuHealth]:
        """Every GPU's health now (blocking: NVML calls), the replicas holding each from
        `holders`; a GPU found failing is fenced."""
        nvml = self._start()
        try:
            readings = self._read(nvml) if nvml is not None else {}
            failure = None
        except Exception as exc:  # never the heartbeat's end: unknown this time, fences kept
            readings, failure = {}, f"reading NVML failed: {exc}"
            if failure != self._last_failure:
                log.warning("GPU health: %s", failure)
        self._last_failure = failure
        report = []
        for device in self.devices:
            held = holders.get(device.index, [])
            reading = readings.get(device.index)
            if reading is None:
                why = failure or self._problem or "NVML does not list this GPU"
                state, reasons = "unknown", [why]
            else:
                state, reasons = assess(reading)
            if state == "failed" and device.index not in self.fences:
                log.error(
                    "GPU %d (%s) is fenced: %s (held by replicas: %s)",
                    device.index,
                    device.kind,
                    "; ".join(reasons),
                    ", ".join(held) or "none",
                )
                self.fences[device.index] = _Fence(reasons, reading is not None and reading.lost)
            fence = self.fences.get(device.index)
            if fence is not None and state != "failed":  # a past event: still fenced
                state, reasons = "failed", fence.reasons
            report.append(
                wire.GpuHealth(
                    index=device.index,
                    kind=device.kind,
                    state=state,  # type: ignore[arg-type]
                    reasons=reasons,
                    fenced=fence is not None,
                    lost=fence is not None and fence.lost,
                    replicas=held,
                )
            )
        return report

    def _start(self) -> Any:
        if self._started:
            return self._nvml
        self._started = True
        try:
            nvml = self.nvml_module()
            nvml.nvmlInit()
        except ImportError:
            self._problem = "nvidia-ml-py is not installed (the `gpu` extra)"
        except Exception as exc:  # no driver: NVML says so by raising
            self._problem = f"NVML is not available: {exc}"
        else:
            self._nvml = nvml
            self._events = self._event_set(nvml)
        if self._problem is not None and self.devices:
            log.warning("GPU health is unknown on this node: %s", self._problem)
        return self._nvml

    def _handles(self, nvml: Any) -> dict[int, Any]:
        """NVML's handle of each device, by its UUID where known, else its index."""
        handles = {}
        for device in self.devices:
            try:
                if device.uuid is not None:
                    handles[device.index] = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
                else:
                    handles[device.index] = nvml.nvmlDeviceGetHandleByIndex(device.index)
            except nvml.NVMLError as error:
                if _code(error) == NVML_ERROR_GPU_IS_LOST:
                    handles[device.index] = None  # lost: no handle to read
        return handles

    def _event_set(self, nvml: Any) -> Any:
        try:
            events = nvml.nvmlEventSetCreate()
            for index, handle in self._handles(nvml).items():
                if handle is not None:
                    nvml.nvmlDeviceRegisterEvents(
                        handle, nvml.nvmlEventTypeXidCriticalError, events
                    )
                    # Events name their device by a handle of their own: known by UUID.
                    self._uuids[_text(nvml.nvmlDeviceGetUUID(handle))] = index
        except nvml.NVMLError as error:
            log.warning("XID events cannot be watched on this node: %s", error)
            return None
        return events

    def _read(self, nvml: Any) -> dict[int, GpuReading]:
        handles = self._handles(nvml)
        xids = self._drain_xids(nvml)
        readings = {}
        for index, handle in handles.items():
            if handle is None:
                readings[index] = GpuReading(lost=True)
                continue
            try:
                readings[index] = _reading(nvml, handle, tuple(xids.get(index, ())))
            except nvml.NVMLError as error:
                if _code(error) == NVML_ERROR_GPU_IS_LOST:
                    readings[index] = GpuReading(lost=True)
                else:
                    log.warning("reading GPU %d's health failed: %s", index, error)
        return readings

    def _drain_xids(self, nvml: Any) -> dict[int, list[int]]:
        """The XID events since the last check, by device index: as many as come within
        EVENTS_SECONDS (a storm of one GPU's events waits for the next check; NVML keeps
        them meanwhile)."""
        if self._events is None:
            return {}
        found: dict[int, list[int]] = {}
        deadline = time.monotonic() + EVENTS_SECONDS
        while time.monotonic() < deadline:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as error:
                if _code(error) != NVML_ERROR_TIMEOUT:
                    log.warning("reading XID events failed: %s", error)
                break
            try:
                index = self._uuids.get(_text(nvml.nvmlDeviceGetUUID(event.device)))
            except nvml.NVMLError:
                continue  # a device that cannot say which it is: its reads will
            if index is not None:
                found.setdefault(index, []).append(int(event.eventData))
        return found


def _code(error: Any) -> int | None:
    return getattr(error, "value", None)


def _reading(nvml: Any, handle: Any, xids: tuple[int, ...]) -> GpuReading:
    """One GPU's reading (NVMLError when it cannot be read)."""
    rows = _supported(nvml, nvml.nvmlDeviceGetRemappedRows, handle)
    return GpuReading(
        xids=xids,
        uncorrected_ecc=int(
            _supported(
                nvml,
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            or 0
        ),
        retirement_pending=bool(
            _supported(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        ),
        remap_failed=bool(rows[3]) if rows is not None else False,
        clock_reasons=int(
            _supported(nvml, nvml.nvmlDeviceGetCurrentClocksEventReasons, handle) or 0
        ),
    )


def _supported(nvml: Any, read: Callable[..., Any], *args: Any) -> Any:
    """What `read(*args)` says, or None where the GPU does not support it (no ECC on most
    consumer GPUs, no row remapping before Ampere)."""
    try:
        return read(*args)
    except nvml.NVMLError as error:
        if _code(error) == NVML_ERROR_NOT_SUPPORTED:
            return None
        raise


def _text(value: Any) -> str:
    """A string NVML gives as bytes or str, depending on the bindings' version."""
    return value.decode() if isinstance(value, bytes) else str(value)
