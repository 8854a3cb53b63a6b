"""What a node offers: GPU types from driver names, nvidia-smi's list, declared GPUs."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from ember.errors import InvalidError
from ember_worker import resources
from ember_worker.resources import GpuDevice, declared_gpus, gpu_counts, gpu_kind_of


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10G"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 4090", "GEFORCE-RTX-4090"),
    ],
)
def test_gpu_kind_of(name: str, kind: str) -> None:
    assert gpu_kind_of(name) == kind


SMI = """\
0, GPU-5b1c2d3e-aaaa-bbbb-cccc-000000000000, NVIDIA H200
1, GPU-5b1c2d3e-aaaa-bbbb-cccc-000000000001, NVIDIA H200
"""


def test_parse_nvidia_smi() -> None:
    devices = resources.parse_nvidia_smi(SMI + "\nNo devices were found\n")
    assert devices == [
        GpuDevice("H200", 0, "GPU-5b1c2d3e-aaaa-bbbb-cccc-000000000000"),
        GpuDevice("H200", 1, "GPU-5b1c2d3e-aaaa-bbbb-cccc-000000000001"),
    ]
    assert gpu_counts(devices) == {"H200": 2}


def test_detect_gpus_asks_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources.shutil, "which", lambda name: f"/bin/{name}")
    asked: list[list[str]] = []

    def run(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, SMI, "")

    assert len(resources.detect_gpus(run)) == 2
    assert asked == [["/bin/nvidia-smi", *resources.NVIDIA_SMI_QUERY]]

    def failing(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 9, "", "NVIDIA-SMI has failed\n")

    assert resources.detect_gpus(failing) == []


def test_no_nvidia_smi_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources.shutil, "which", lambda name: None)
    assert resources.detect_gpus() == []


def test_declared_gpus() -> None:
    assert declared_gpus("H100:2,L4") == [
        GpuDevice("H100", 0),
        GpuDevice("H100", 1),
        GpuDevice("L4", 2),
    ]
    assert declared_gpus("none") == []
    with pytest.raises(InvalidError, match="unknown GPU type"):
        declared_gpus("Z9:1")
