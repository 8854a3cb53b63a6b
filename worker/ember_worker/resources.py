"""What this node offers: CPUs, memory and GPUs."""

from __future__ import annotations

import os

import psutil

from ember.settings import parse_gpu


def detect_cpu() -> float:
    return float(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )


def detect_memory_mib() -> int:
    return int(psutil.virtual_memory().total // (1024 * 1024))


def parse_gpus(spec: str | None) -> dict[str, int]:
    """`--gpus H100:8,L4:2` as declared by an operator; NVML detection comes with GPU nodes."""
    gpus: dict[str, int] = {}
    for item in (spec or "").split(","):
        if item.strip():
            kind, count = parse_gpu(item.strip())
            if kind:
                gpus[kind] = gpus.get(kind, 0) + count
    return gpus
