"""What a replica's user is given on a node: its working area, its bundle and volume
folders, its GPUs' device nodes; and nothing of the worker's records or images."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from machine_needs import need

from ember_worker.agent.config import AgentConfig
from ember_worker.agent.replicas.replica_access import ReplicaAccess, gpu_device_nodes
from ember_worker.processes import file_grants
from ember_worker.processes.file_grants import RX, USER
from ember_worker.resources import GpuDevice


def test_a_replica_opens_the_device_nodes_of_its_gpus_only(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert gpu_device_nodes([], tmp_path) == []
    held = gpu_device_nodes([GpuDevice("H100", 1)], tmp_path)
    assert held == [tmp_path / "nvidia1", tmp_path / "nvidiactl", tmp_path / "nvidia-uvm"]


def test_the_work_dir_lets_a_replica_reach_its_own_and_nothing_else(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        need("root", "giving folders to other uids needs root")
    work = tmp_path / "worker"
    config = AgentConfig("https://cp", "t", None, work, "node", 1.0, 1024)
    access = ReplicaAccess.for_node(config)
    access.prepare_node()
    assert (work.stat().st_mode & 0o777, (work / "snapshots").stat().st_mode & 0o777) == (
        0o711,
        0o700,
    )
    bundle = work / "bundles" / "sha256-ab"
    bundle.mkdir(mode=0o755)
    user = access.user_for("team--shop")
    assert user == access.user_for("team--other-app")  # one user per workspace
    assert user != access.user_for("shop")  # main's
    home = access.prepare(
        user,
        replica_id="r-1",
        app_key="team--shop",
        bundle_dir=bundle,
        python=sys.executable,
    )
    assert home == work / "replicas" / "r-1"
    for folder in (home, home / "tmp", work / "volumes" / "team--shop"):  # by app key
        assert (folder.stat().st_uid, folder.stat().st_mode & 0o777) == (user.uid, 0o700)
    assert (USER, RX, user.uid) in file_grants.read_acl(bundle)
    assert bundle.stat().st_mode & 0o007 == 0  # closed to everyone else
    assert (work / "replica-users.json").stat().st_mode & 0o777 == 0o600
    access.release("r-1")
    assert not home.exists()
    with pytest.raises(FileNotFoundError):
        access.home("r-1").stat()
