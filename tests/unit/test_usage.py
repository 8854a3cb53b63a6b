"""Usage: replicas' records summed per endpoint within a period; a replica's end is
recorded by the control plane (driven on a real `Cluster`, as in test_cluster)."""

from __future__ import annotations

from pathlib import Path

from cluster_harness import APP, ENDPOINT, Env, run

from ember_platform.observability.usage import summarize
from ember_platform.storage.records import ReplicaUsage


def record(replica: str, endpoint: str, started: float, ended: float, **extra) -> ReplicaUsage:  # type: ignore[no-untyped-def]
    fields = {
        "gpu_type": None,
        "gpu_count": 0,
        "cpu": 2.0,
        "memory_mib": 2048,
        "start_kind": "cold",
        "inputs": 10,
    } | extra
    return ReplicaUsage(replica, "app", endpoint, started_at=started, ended_at=ended, **fields)


def test_replicas_are_summed_per_endpoint_within_the_period() -> None:
    records = [
        record("r1", "a", 0.0, 100.0),  # half inside [50, 150]
        record("r2", "a", 60.0, 80.0, start_kind="restore", inputs=3),
        record("r3", "b", 100.0, 400.0, gpu_type="H100", gpu_count=2),  # clipped to 150
        record("r4", "c", 0.0, 10.0),  # outside: not counted
    ]
    a, b = summarize(records, since=50.0, until=150.0)
    assert (a.endpoint, a.replicas, a.replica_seconds) == ("a", 2, 70.0)
    assert a.cpu_seconds == 140.0 and a.gib_seconds == 140.0
    assert a.starts == {"restore": 1}  # r1 started before the period
    assert a.inputs == 13
    assert (b.replica_seconds, b.gpu_seconds) == (50.0, {"H100": 100.0})
    assert b.to_dict()["gpu_seconds"] == {"H100": 100.0}


def test_a_replica_that_ends_is_recorded_with_what_it_held(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, cpu=1.5, memory=1024)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "result", inp, b"{}")
        env.exited(replica, returncode=0)
        (usage,) = env.store.usage_since(0.0)
        assert (usage.app, usage.endpoint, usage.replica_id) == (APP, ENDPOINT, replica.id)
        assert (usage.cpu, usage.memory_mib, usage.inputs) == (1.5, 1024, 1)
        assert usage.start_kind == "cold" and usage.ended_at >= usage.started_at
        assert env.store.delete_usage_before(usage.ended_at + 1) == 1

    run(tmp_path, scenario)


def test_replicas_alive_at_a_stop_are_recorded_once(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        inp = env.submit()
        (replica,) = env.start_ready()
        env.reply(replica, "result", inp, b"{}")
        assert env.cluster.replica_lifecycle.record_live_usage() == 1
        (usage,) = env.store.usage_since(0.0)
        assert usage.replica_id == replica.id and usage.inputs == 1
        env.exited(replica, returncode=0)  # its end, reported late: not counted again
        assert len(env.store.usage_since(0.0)) == 1

    run(tmp_path, scenario)
