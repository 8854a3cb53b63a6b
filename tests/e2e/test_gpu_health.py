"""GPU health: a worker with two declared H100s whose NVML answers a test scripts (the
worker's fault-injection seam, `EMBER_NVML_SCRIPT`: these machines have no GPU). A GPU
that fails is fenced, its replica replaced on the other, the node says so in `ember node
ls` and `/metrics`, and the operator brings it back with `ember node uncordon --gpu`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform, wait_for
from prometheus_client.parser import text_string_to_metric_families

import ember

APP = "gpu-health"
HEALTHY: dict[str, object] = {"xids": [], "lost": False}


class Script:
    """The NVML answers the worker reads, one entry per GPU."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gpus = [dict(HEALTHY), dict(HEALTHY)]
        self.write()

    def set(self, index: int, **condition: object) -> None:
        self.gpus[index] = {**self.gpus[index], **condition}
        self.write()

    def write(self) -> None:
        temporary = self.path.with_suffix(".new")
        temporary.write_text(json.dumps({"gpus": self.gpus}))
        temporary.replace(self.path)  # the worker never reads half a script


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Script:
    return Script(tmp_path_factory.mktemp("nvml") / "nvml.json")


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, script: Script, apps_dir: Path
) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("gpu-health")
    env = {"EMBER_NVML_SCRIPT": str(script.path)}
    with running_platform(root, extra=("--gpus", "H100:2"), env=env) as running:
        running.deploy(apps_dir / "gpu_health.py", APP)
        yield running


def node(platform: Platform) -> dict:
    (worker,) = platform.status()["workers"]
    return worker


def health(platform: Platform) -> dict[int, dict]:
    return {gpu["index"]: gpu for gpu in node(platform)["gpu_health"]}


def gauges(platform: Platform) -> dict[tuple[str, str], float]:
    """(gpu, state) -> ember:gpu_health, and (gpu, "fenced") -> ember:gpu_fenced."""
    with platform.client() as client:
        text = client.get("/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ember:gpu_health":
                found[(sample.labels["gpu"], sample.labels["state"])] = sample.value
            elif sample.name == "ember:gpu_fenced":
                found[(sample.labels["gpu"], "fenced")] = sample.value
    return found


def test_a_lost_gpu_is_fenced_its_replica_replaced_and_it_comes_back_uncordoned(
    platform: Platform, script: Script
) -> None:
    held = ember.Endpoint.lookup(APP, "held", config=platform.config())
    states = lambda: [g["state"] for g in health(platform).values()]  # noqa: E731
    assert wait_for(lambda: states() == ["healthy", "healthy"], 30)
    first = held.call()
    assert first in ("0", "1")
    lost, other = int(first), 1 - int(first)
    listing = platform.ember("node", "ls").stdout
    assert "2 healthy" in listing

    # The replica's GPU falls off the bus: NVML says so of every read.
    script.set(lost, lost=True)
    assert wait_for(lambda: health(platform)[lost]["fenced"], 30)
    gpu = health(platform)[lost]
    assert (gpu["state"], gpu["reasons"], gpu["lost"]) == ("failed", ["lost from the bus"], True)
    # Replaced at once, on the other GPU: the next call answers from there.
    assert held.call() == str(other)
    listing = platform.ember("node", "ls").stdout
    assert f"GPU {lost} fenced: lost from the bus" in listing and "1 healthy" in listing
    metrics = gauges(platform)
    assert metrics[(str(lost), "failed")] == 1 and metrics[(str(lost), "healthy")] == 0
    assert metrics[(str(lost), "fenced")] == 1 and metrics[(str(other), "fenced")] == 0
    logs = platform.ember("logs", APP).stdout
    assert f"GPU {lost} of node" in logs and "lost from the bus" in logs

    # Uncordoned while still lost: the worker's next check fences it again (its log, in
    # the server's output, says each fence; the uncordon lifted the first).
    def fences() -> int:
        return sum(f"GPU {lost} (H100) is fenced" in line for line in platform.output)

    before = fences()
    platform.ember("node", "uncordon", node(platform)["name"], "--gpu", str(lost))
    assert wait_for(lambda: fences() > before, 30)
    assert health(platform)[lost]["fenced"]

    # Repaired (the script says it answers again), then uncordoned: it takes replicas.
    script.set(lost, lost=False)
    done = platform.ember("node", "uncordon", node(platform)["name"], "--gpu", str(lost))
    assert f"GPU {lost} of node" in done.stdout
    assert wait_for(lambda: health(platform)[lost]["state"] == "healthy", 30)
    assert not health(platform)[lost]["fenced"]
    assert gauges(platform)[(str(lost), "fenced")] == 0


def test_conditions_short_of_fatal_do_not_fence_and_a_fatal_xid_does(
    platform: Platform, script: Script
) -> None:
    idle = 1 - int(ember.Endpoint.lookup(APP, "held", config=platform.config()).call())
    # A thermal slowdown degrades; an XID that is not critical (13: a graphics engine
    # exception, the application's fault) changes nothing.
    script.set(idle, clock_reasons=0x40, xids=[13])
    assert wait_for(lambda: health(platform)[idle]["state"] == "degraded", 30)
    gpu = health(platform)[idle]
    assert gpu["reasons"] == ["hardware thermal slowdown"] and not gpu["fenced"]
    # XID 48 (a double-bit ECC error): fenced, though it held no replica.
    script.set(idle, clock_reasons=0, xids=[13, 48])
    assert wait_for(lambda: health(platform)[idle]["fenced"], 30)
    assert health(platform)[idle]["reasons"] == ["XID 48"]
    # The event is past, the GPU stays fenced until the operator says otherwise.
    assert health(platform)[idle]["state"] == "failed"
    name = node(platform)["name"]
    platform.ember("node", "uncordon", name, "--gpu", str(idle))
    assert wait_for(lambda: health(platform)[idle]["state"] == "healthy", 30)


def test_uncordoning_a_gpu_that_is_not_fenced_says_so(platform: Platform) -> None:
    name = node(platform)["name"]
    refused = platform.ember("node", "uncordon", name, "--gpu", "1", check=False)
    assert refused.returncode != 0
    assert f"GPU 1 of node {name} is not fenced" in refused.stderr
    unknown = platform.ember("node", "uncordon", "no-such-node", "--gpu", "0", check=False)
    assert unknown.returncode != 0 and "no worker node named no-such-node" in unknown.stderr
    negative = platform.ember("node", "uncordon", name, "--gpu", "-1", check=False)
    assert negative.returncode == 2 and "a GPU's index is a number from 0" in negative.stderr
    with platform.client() as client:
        for index in ("9" * 5000, "x1"):
            answer = client.post(f"/v1/nodes/{name}/gpus/{index}/uncordon")
            assert answer.status_code == 400, answer.text
            assert "a GPU's index is a number from 0" in answer.json()["error"]["message"]
