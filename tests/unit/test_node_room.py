"""A node's own check of each replica start against the CPUs and memory its replicas were
placed for: it fits up to the node's --cpu and --memory, and past them it is refused with
the sums said; and the agent refuses such a start without launching anything."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.replicas.lifecycle import ReplicaRuns
from ember_worker.agent.replicas.node_room import booked, refusal
from ember_worker.agent.running_replica import RunningReplica


def running(cpu: float | None, memory: int | None) -> RunningReplica:
    return RunningReplica("r-1", "default/app", "f", cpu=cpu, memory_mib=memory)


def test_a_start_fits_up_to_the_node_and_no_further() -> None:
    ten = [running(0.1, 100) for _ in range(10)]  # 1.0000000000000002 CPUs in floats
    assert refusal(ten, cpu=2.0, memory_mib=2000, wants_cpu=1.0, wants_memory_mib=1000) is None
    over_cpu = refusal(ten, cpu=2.0, memory_mib=4000, wants_cpu=1.5, wants_memory_mib=10)
    assert over_cpu == (
        "the node's replicas have 1 of its 2 CPUs and 1000 of its 4000 MiB; "
        "this one asks 1.5 CPUs and 10 MiB"
    )
    assert refusal(ten, cpu=4.0, memory_mib=1500, wants_cpu=0.1, wants_memory_mib=501)


def test_what_asks_for_nothing_books_nothing() -> None:
    old = [running(None, None), running(2.0, 4096)]  # an older control plane's start
    assert refusal(old, cpu=2.0, memory_mib=4096, wants_cpu=None, wants_memory_mib=None) is None
    assert refusal(old, cpu=2.0, memory_mib=4096, wants_cpu=0.01, wants_memory_mib=None)


def test_a_replica_whose_process_ended_books_nothing() -> None:
    """Its record stays a while (its last output read), its share goes with its process."""
    ended = running(1.5, 3000)
    ended.process = SimpleNamespace(returncode=3)  # type: ignore[assignment]
    live = running(0.5, 1000)
    live.process = SimpleNamespace(returncode=None)  # type: ignore[assignment]
    assert booked([ended, live]) == (0.5, 1000)
    assert refusal([ended, live], cpu=2.0, memory_mib=4096, wants_cpu=1.6, wants_memory_mib=1)
    assert not refusal([ended, live], cpu=2.0, memory_mib=4096, wants_cpu=1.5, wants_memory_mib=1)


class Unreached:
    """What the agent would launch with: a refused start reaches none of it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a refused start used {name}")


def test_the_agent_refuses_a_start_past_its_room_without_launching_it(tmp_path: Path) -> None:
    sent: list[wire.FromAgent] = []

    async def send(message: Any) -> None:
        sent.append(message)

    config = AgentConfig(
        server_url="https://127.0.0.1:1", token="t", ca_cert=None, name="n", cpu=1.0, memory=1024,
        work_dir=tmp_path,
    )  # fmt: skip
    replicas = {"r-old": running(0.75, 512)}
    runs = ReplicaRuns(
        config, replicas, launcher=Unreached(), gpu_slots=Unreached(), limits=Unreached(),
        execs=Unreached(), logs=Unreached(), volume_copies=Unreached(), send=send,
    )  # type: ignore[arg-type]  # fmt: skip
    start = wire.StartReplica(
        replica_id="r-new", token="x", app="default/app", endpoint="f", label="app--f",
        version=1, bundle_digest="sha256:0", entry="app.py", attribute="f", concurrency=1,
        cpu=0.5, memory=256,
    )  # fmt: skip
    asyncio.run(runs.start(start))
    assert list(replicas) == ["r-old"]
    (exited,) = sent
    assert isinstance(exited, wire.ReplicaExited)
    assert exited.replica_id == "r-new" and exited.node_full and not exited.no_room
    assert exited.detail == "cannot start: its CPUs or memory are booked on this node after all"
