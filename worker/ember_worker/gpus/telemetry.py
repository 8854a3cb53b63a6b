"""GPU power, temperature and utilisation through NVML (`nvidia-ml-py`), where present.

On a node without NVIDIA GPUs, or without the package, `GpuTelemetry.sample()` returns
nothing and says why once in the worker's log: nothing else depends on it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("ember.worker.gpu")


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    power_watts: float
    temperature_celsius: float
    utilization_ratio: float  # 0..1, of the last sample period
    memory_used_bytes: int
    memory_total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GpuTelemetry:
    def __init__(self) -> None:
        self._nvml: Any = None
        self._problem: str | None = None
        self._started = False

    def sample(self) -> list[GpuSample]:
        nvml = self._start()
        if nvml is None:
            return []
        samples = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = nvml.nvmlDeviceGetName(handle)
                samples.append(
                    GpuSample(
                        index=index,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        power_watts=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                        temperature_celsius=float(
                            nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                        ),
                        utilization_ratio=nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,
                        memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total),
                    )
                )
        except Exception as exc:  # NVML errors are its own class tree; a bad read is skipped
            log.warning("reading GPU telemetry failed: %s", exc)
            return []
        return samples

    def _start(self) -> Any:
        if self._started:
            return self._nvml
        self._started = True
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            self._problem = "nvidia-ml-py is not installed (the `gpu` extra)"
        except Exception as exc:  # no driver, no GPU: NVML says so by raising
            self._problem = f"NVML is not available: {exc}"
        else:
            self._nvml = pynvml
        if self._problem is not None:
            log.info("no GPU telemetry on this node: %s", self._problem)
        return self._nvml
