"""What this node offers: CPUs, memory and GPUs (detected with nvidia-smi, or declared)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from ember.declarations.settings import GPU_ALIASES, GPU_TYPES, parse_gpu

log = logging.getLogger("ember.worker")

NVIDIA_SMI_QUERY = ["--query-gpu=index,uuid,name", "--format=csv,noheader"]
NVIDIA_SMI_TIMEOUT = 15.0


@dataclass(frozen=True)
class GpuDevice:
    """One GPU this node offers: its type as endpoints ask for it, its index, and its
    UUID when it was detected (GPUs declared with `--gpus` have none)."""

    kind: str
    index: int
    uuid: str | None = None

    @property
    def visible_id(self) -> str:
        """How CUDA_VISIBLE_DEVICES names it: the UUID when known (it does not change
        with the driver's numbering), else the index."""
        return self.uuid or str(self.index)


def detect_cpu() -> float:
    return float(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )


def detect_memory_mib() -> int:
    return int(psutil.virtual_memory().total // (1024 * 1024))


def parse_gpus(spec: str | None) -> dict[str, int]:
    """`--gpus H100:8,L4:2` as declared by an operator: GPUs by type."""
    gpus: dict[str, int] = {}
    for item in (spec or "").split(","):
        if item.strip() and item.strip().lower() != "none":
            kind, count = parse_gpu(item.strip())
            if kind:
                gpus[kind] = gpus.get(kind, 0) + count
    return gpus


def declared_gpus(spec: str) -> list[GpuDevice]:
    """The devices of `--gpus H100:2,L4:1`, numbered from 0 in that order; `none` offers
    none, even where GPUs are present."""
    devices: list[GpuDevice] = []
    for kind, count in parse_gpus(spec).items():
        devices += [GpuDevice(kind, len(devices) + n) for n in range(count)]
    return devices


def gpu_counts(devices: Iterable[GpuDevice]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for device in devices:
        counts[device.kind] = counts.get(device.kind, 0) + 1
    return counts


def gpu_kind_of(name: str) -> str:
    """The GPU type endpoints ask for, from the name the driver reports: "NVIDIA H100 80GB
    HBM3" is "H100", "NVIDIA A100-SXM4-80GB" "A100-80GB", "Tesla T4" "T4". A model outside
    Ember's list keeps its own name, upper-case and dashed ("GEFORCE-RTX-4090")."""
    upper = name.upper()
    words = upper.replace("NVIDIA", " ").replace("TESLA", " ").split()
    if not words:
        return "UNKNOWN"
    base = words[0].split("-")[0]
    if base == "A100":
        return "A100-80GB" if "80GB" in upper else "A100"
    if base in GPU_TYPES:
        return base
    if base in GPU_ALIASES:
        return GPU_ALIASES[base]
    return "-".join(words)


def parse_nvidia_smi(text: str) -> list[GpuDevice]:
    """The output of `nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader`."""
    devices = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",", 2)]
        if len(fields) == 3 and fields[0].isdigit():
            index, uuid, name = fields
            devices.append(GpuDevice(gpu_kind_of(name), int(index), uuid or None))
    return devices


def detect_gpus(run: Callable[..., Any] = subprocess.run) -> list[GpuDevice]:
    """The NVIDIA GPUs nvidia-smi lists; none where it is missing or fails (said once)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        result = run(
            [binary, *NVIDIA_SMI_QUERY],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("no GPUs offered: nvidia-smi did not answer (%s)", exc)
        return []
    if result.returncode != 0:
        why = (result.stderr or result.stdout).strip().splitlines()
        log.warning("no GPUs offered: nvidia-smi failed (%s)", why[-1] if why else "no output")
        return []
    return parse_nvidia_smi(result.stdout)
