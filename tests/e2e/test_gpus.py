"""GPUs on a node: each replica is shown the GPUs it holds and no other, a replica
restored from a snapshot too. The worker declares two H100s (`ember server --gpus`), or
finds two H200s with an nvidia-smi that the test puts first on PATH."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, replicas_ready, running_platform, wait_for
from machine_needs import need

import ember

APP = "gpus"


@pytest.fixture(scope="module")
def gpu_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("gpu-platform")
    with running_platform(root, extra=("--gpus", "H100:2")) as running:
        yield running


@pytest.fixture(scope="module")
def deployed(gpu_platform: Platform, apps_dir: Path) -> Platform:
    gpu_platform.deploy(apps_dir / "gpus.py", APP)
    return gpu_platform


# Answers the two queries Ember makes: the worker's GPU list and the snapshot key's
# model and driver.
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
    *index,uuid,name*)
        echo "0, GPU-00000000-1111-2222-3333-444444444444, NVIDIA H200"
        echo "1, GPU-00000000-1111-2222-3333-555555555555, NVIDIA H200" ;;
    *name,driver_version*) echo "NVIDIA H200, 580.95.05" ;;
    *) exit 9 ;;
esac
"""


@pytest.fixture(scope="module")
def detecting_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("detecting-platform")
    tools = root / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    with running_platform(root, env=env) as running:
        yield running


def _endpoint(platform: Platform, name: str) -> ember.Endpoint:
    return ember.Endpoint.lookup(APP, name, config=platform.config())


def _replicas(platform: Platform, name: str) -> int:
    return sum(platform.endpoint_status(f"{APP}--{name}")["replicas"].values())


def test_the_worker_offers_its_declared_gpus(deployed: Platform) -> None:
    (worker,) = deployed.status()["workers"]
    assert worker["gpus"] == {"H100": 2}


def test_two_replicas_hold_one_gpu_each(deployed: Platform) -> None:
    one_gpu = _endpoint(deployed, "one-gpu")
    # Both replicas are up before the calls, so each call finds one free however far
    # apart their cold boots end on a loaded machine.
    with replicas_ready(deployed, one_gpu, 2), ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda _: one_gpu.call(seconds=2.0), range(2)))
    assert len({a["pid"] for a in answers}) == 2
    assert sorted(a["visible"] for a in answers) == ["0", "1"]
    logs = deployed.ember("logs", APP).stdout
    assert "holds GPU H100 #0 (0)" in logs and "holds GPU H100 #1 (1)" in logs
    # Both GPUs come free when their replicas end, so a new replica gets one.
    wait_for(lambda: _replicas(deployed, "one-gpu") == 0, 30)
    assert one_gpu.call()["visible"] in {"0", "1"}


def test_a_replica_without_a_gpu_is_shown_none(deployed: Platform) -> None:
    assert _endpoint(deployed, "no-gpu").call()["visible"] == ""


def test_a_restored_replica_is_shown_its_own_gpu(deployed: Platform) -> None:
    problem = deployed.status()["workers"][0]["snapshots"].get("problem")
    if problem:
        need("criu", f"snapshots are off on this machine: {problem}")
    restored_gpu = _endpoint(deployed, "restored-gpu")
    first = restored_gpu.call()  # boots cold on a GPU; its snapshot names that GPU
    label = f"{APP}--restored-gpu"
    wait_for(lambda: deployed.endpoint_status(label).get("snapshots"), 60)
    # While the first replica holds its GPU, a second one is restored onto the other:
    # the environment frozen in the image named the first one's. It is ready before the
    # calls, which take one replica each however long the restore took.
    with replicas_ready(deployed, restored_gpu, 2), ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda _: restored_gpu.call(seconds=2.0), range(2)))
    by_pid = {a["pid"]: a["visible"] for a in [first, *answers]}
    assert len(by_pid) == 2
    assert sorted(by_pid.values()) == ["0", "1"]
    assert deployed.endpoint_status(label)["last_start"]["kind"] == "restore"


def test_a_later_gpu_choice_is_taken_where_the_first_is_missing(deployed: Platform) -> None:
    answer = _endpoint(deployed, "either-gpu").call()
    assert answer["visible"] in {"0", "1"}  # an H100: the worker has no A100
    assert "holds GPU H100 #" in deployed.ember("logs", f"{APP}/either-gpu").stdout
    assert "gpu=A100,H100" in deployed.ember("ls").stdout
    wait_for(lambda: _replicas(deployed, "either-gpu") == 0, 30)


def test_a_worker_offers_the_gpus_nvidia_smi_lists(
    detecting_platform: Platform, apps_dir: Path
) -> None:
    (worker,) = detecting_platform.status()["workers"]
    assert worker["gpus"] == {"H200": 2}
    (apps_dir / "h200.py").write_text(
        (apps_dir / "gpus.py").read_text().replace('gpu="H100"', 'gpu="H200"')
    )
    detecting_platform.deploy(apps_dir / "h200.py", APP)
    # By UUID: the driver's numbering may differ from nvidia-smi's.
    shown = _endpoint(detecting_platform, "one-gpu").call()["visible"]
    assert shown == "GPU-00000000-1111-2222-3333-444444444444"


def test_idle_replicas_make_room_for_queued_work(deployed: Platform) -> None:
    # Both GPUs held by an idle replica that would not scale down for ten minutes.
    assert len(_endpoint(deployed, "both-gpus").call()["visible"].split(",")) == 2
    # Answered within two minutes: it did not wait out the ten-minute scale-down.
    assert _endpoint(deployed, "one-gpu").call(_timeout=120)["visible"] in ("0", "1")
    logs = deployed.ember("logs", APP).stdout
    assert "stopping an idle replica: its node has no room for gpus--one-gpu" in logs
