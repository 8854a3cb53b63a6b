"""GPU health's judgement (gpu_health.assess), its fences over NVML's scripted answers
(scripted_nvml: the worker's fault-injection seam, since these machines have no GPU), and
a fenced GPU never given to a replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.wire import messages as wire
from ember_platform.runtime.cluster_model import Worker
from ember_worker.gpu_slots import GpuSlots, NoFreeGpu
from ember_worker.gpus import scripted_nvml
from ember_worker.gpus.health import GpuHealthWatch, GpuReading, assess
from ember_worker.resources import GpuDevice

DEVICES = [GpuDevice("H100", 0), GpuDevice("H100", 1)]


def test_each_condition_is_judged() -> None:
    assert assess(GpuReading()) == ("healthy", [])
    assert assess(GpuReading(lost=True)) == ("failed", ["lost from the bus"])
    assert assess(GpuReading(xids=(13, 31))) == ("healthy", [])  # the application's faults
    assert assess(GpuReading(xids=(79, 13))) == ("failed", ["XID 79"])
    assert assess(GpuReading(uncorrected_ecc=2)) == ("failed", ["2 double-bit ECC errors"])
    assert assess(GpuReading(retirement_pending=True)) == ("failed", ["pages pending retirement"])
    assert assess(GpuReading(remap_failed=True)) == ("failed", ["row remapping failed"])
    assert assess(GpuReading(clock_reasons=0x40 | 0x80)) == (
        "degraded",
        ["hardware thermal slowdown", "power brake slowdown"],
    )
    # Fatal wins over slow.
    assert assess(GpuReading(xids=(48,), clock_reasons=0x40))[0] == "failed"


def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[dict]) -> Path:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"gpus": gpus}))
    monkeypatch.setenv(scripted_nvml.SCRIPT_ENV, str(path))
    monkeypatch.setattr(scripted_nvml, "_delivered", {})
    return path


def test_a_failed_gpu_stays_fenced_until_uncordoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = scripted(tmp_path, monkeypatch, [{"xids": [64]}, {}])
    watch = GpuHealthWatch(DEVICES, scripted_nvml.nvml_module)
    first = watch.check({0: ["r-1"]})
    assert [(g.state, g.fenced, g.reasons, g.replicas) for g in first] == [
        ("failed", True, ["XID 64"], ["r-1"]),
        ("healthy", False, [], []),
    ]
    # The event was delivered once; the fence holds.
    again = watch.check({})
    assert (again[0].state, again[0].fenced, again[0].reasons) == ("failed", True, ["XID 64"])
    assert watch.fenced() == {0}
    assert watch.uncordon(0) and not watch.uncordon(0)
    assert watch.check({})[0].state == "healthy"
    # A GPU that vanishes from NVML's list is lost.
    path.write_text(json.dumps({"gpus": [{}]}))
    lost = watch.check({})[1]
    assert (lost.state, lost.fenced, lost.lost) == ("failed", True, True)


def test_without_nvml_health_is_unknown_never_healthy() -> None:
    def missing() -> None:
        raise ImportError("No module named 'pynvml'")

    report = GpuHealthWatch(DEVICES, missing).check({})
    assert [(g.state, g.fenced) for g in report] == [("unknown", False), ("unknown", False)]
    assert report[0].reasons == ["nvidia-ml-py is not installed (the `gpu` extra)"]


def test_a_fenced_gpu_is_never_given_to_a_replica() -> None:
    fenced = {0}
    slots = GpuSlots(DEVICES, fenced=lambda: fenced)
    assert [d.index for d in slots.take("r-1", "H100", 1)] == [1]
    with pytest.raises(NoFreeGpu, match="1 fenced for their health"):
        slots.take("r-2", "H100", 1)
    assert slots.holders() == {1: ["r-1"]}
    fenced.clear()
    assert [d.index for d in slots.take("r-2", "H100", 1)] == [0]


def test_a_failing_read_leaves_health_unknown_and_fences_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = scripted(tmp_path, monkeypatch, [{"xids": [79]}, {}])
    watch = GpuHealthWatch(DEVICES, scripted_nvml.nvml_module)
    assert watch.check({})[0].fenced
    path.write_text("{not json")  # any error of a read: the heartbeat goes on
    report = watch.check({})
    assert [(g.state, g.fenced) for g in report] == [("failed", True), ("unknown", False)]
    assert report[1].reasons[0].startswith("reading NVML failed")


def test_the_seam_reads_no_script_others_may_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = scripted(tmp_path, monkeypatch, [{}, {}])
    path.chmod(0o666)
    report = GpuHealthWatch(DEVICES, scripted_nvml.nvml_module).check({})
    assert {g.state for g in report} == {"unknown"}
    assert "may be written by others" in report[0].reasons[0]


def test_a_fenced_gpu_counts_as_used_once_its_holder_is_let_go() -> None:
    worker = Worker("w-1", "node", 8.0, 16_384, {"H100": 2})
    worker.gpu_health = [
        wire.GpuHealth(index=0, kind="H100", state="failed", fenced=True, replicas=["r-1"]),
        wire.GpuHealth(index=1, kind="H100", state="healthy"),
    ]
    assert worker.fenced_gpus({"r-1"}) == {}  # its replica's own count covers it
    assert worker.fenced_gpus(set()) == {"H100": 1}  # let go of, its process not ended
