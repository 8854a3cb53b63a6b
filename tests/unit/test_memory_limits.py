"""Replica memory cgroups: finding where to make them (v1, v2), limits, OOM counts."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from ember_worker.memory_limits import CgroupTree, ReplicaCgroup, find_tree, joined

MIB = 1024 * 1024


def fake_v1(root: Path) -> tuple[Path, Path, Path]:
    """A cgroup v1 layout under `root`: (mounts file, cgroup file, the agent's group)."""
    memory = root / "sys/fs/cgroup/memory"
    group = memory / "jobs/agent"
    group.mkdir(parents=True)
    mounts = root / "mounts"
    mounts.write_text(
        f"tmpfs {root}/sys/fs/cgroup tmpfs rw 0 0\n"
        f"cgroup {root}/sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
        f"cgroup {memory} cgroup rw,relatime,memory 0 0\n"
    )
    cgroups = root / "cgroup"
    cgroups.write_text("5:cpu:/\n4:memory:/jobs/agent\n0::/\n")
    return mounts, cgroups, group


def fake_v2(root: Path, subtree: str = "") -> tuple[Path, Path, Path]:
    unified = root / "sys/fs/cgroup"
    group = unified / "system.slice/ember.service"
    group.mkdir(parents=True)
    (group / "cgroup.controllers").write_text("cpu io memory pids\n")
    (group / "cgroup.subtree_control").write_text(subtree)
    (group / "cgroup.procs").write_text("101\n102\n")
    mounts = root / "mounts"
    mounts.write_text(f"cgroup2 {unified} cgroup2 rw,nsdelegate 0 0\n")
    cgroups = root / "cgroup"
    cgroups.write_text("0::/system.slice/ember.service\n")
    return mounts, cgroups, group


def test_v1_tree_goes_under_the_agents_memory_group(tmp_path: Path) -> None:
    mounts, cgroups, group = fake_v1(tmp_path)
    stale = group / "ember-999999999"  # a PID no process has: its agent is gone
    (stale / "r-old").mkdir(parents=True)
    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=42)
    assert tree == CgroupTree(1, group / "ember-42")
    assert tree.base.is_dir() and not stale.exists()
    replica = tree.create("r-1", 300)
    assert replica == ReplicaCgroup(group / "ember-42/r-1", 1, 300)
    assert (replica.path / "memory.limit_in_bytes").read_text() == str(300 * MIB)
    assert replica.procs_file == replica.path / "cgroup.procs"
    assert replica.oom_kills() == 0  # no counter file: nothing known
    (replica.path / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    )
    assert replica.oom_kills() == 2


def test_v2_enables_memory_for_children_moving_the_agent_to_a_leaf_when_busy(
    tmp_path: Path,
) -> None:
    mounts, cgroups, group = fake_v2(tmp_path)
    writes: list[tuple[str, str]] = []

    def write(path: Path, text: str) -> None:
        writes.append((str(path.relative_to(group)), text))
        control = group / "cgroup.subtree_control"
        # As the kernel does: no controllers for children while it holds processes.
        if path == control and (group / "cgroup.procs").read_text().split():
            raise OSError(errno.EBUSY, "Device or resource busy")
        if path.name == "cgroup.procs" and path.parent.name == "ember-agent":
            left = (group / "cgroup.procs").read_text().split()
            (group / "cgroup.procs").write_text("\n".join(p for p in left if p != text))
        path.write_text(text)

    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=7, write=write)
    assert tree == CgroupTree(2, group / "ember-7")
    assert writes == [
        ("cgroup.subtree_control", "+memory"),
        ("ember-agent/cgroup.procs", "101"),
        ("ember-agent/cgroup.procs", "102"),
        ("cgroup.subtree_control", "+memory"),
        ("ember-7/cgroup.subtree_control", "+memory"),
    ]
    swap = tree.base / "r-2" / "memory.swap.max"
    swap.parent.mkdir()
    swap.write_text("max")
    replica = tree.create("r-2", 128)
    assert (replica.path / "memory.max").read_text() == str(128 * MIB)
    assert swap.read_text() == "0"
    (replica.path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    assert replica.oom_kills() == 1


def test_where_there_can_be_no_limits_says_why(tmp_path: Path) -> None:
    mounts, cgroups, group = fake_v2(tmp_path)
    (group / "cgroup.controllers").write_text("cpu pids\n")
    found = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=1)
    assert found == "cgroup v2 gives /system.slice/ember.service no memory controller"
    mounts.write_text("proc /proc proc rw 0 0\n")
    assert find_tree(mounts_file=mounts, cgroup_file=cgroups) == (
        "no memory cgroup controller is mounted"
    )
    missing = find_tree(mounts_file=tmp_path / "nope", cgroup_file=cgroups)
    assert isinstance(missing, str) and missing.startswith("cannot read this process's cgroups")


def test_a_refused_limit_leaves_no_group_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Path.write_text

    def refuse_limits(path: Path, text: str) -> int:
        if path.name == "memory.limit_in_bytes":  # as the kernel answers a bad figure
            raise OSError(errno.EINVAL, "Invalid argument")
        return original(path, text)

    monkeypatch.setattr(Path, "write_text", refuse_limits)
    tree = CgroupTree(1, tmp_path / "ember-5")
    tree.base.mkdir()
    with pytest.raises(OSError, match="Invalid argument"):
        tree.create("r-3", 64)
    assert not (tree.base / "r-3").exists()
    tree.remove()
    assert not tree.base.exists()


def test_removing_a_replica_group_waits_for_it_to_empty(tmp_path: Path) -> None:
    replica = ReplicaCgroup(tmp_path / "r-4", 1, 64)
    replica.path.mkdir()
    assert replica.remove() and not replica.path.exists()
    assert replica.remove()  # already gone
    (replica.path / "busy").mkdir(parents=True)  # not EBUSY: no retrying
    assert not replica.remove(attempts=3)


def test_joined_runs_the_command_after_writing_its_pid(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"
    result = subprocess.run(
        joined(["sh", "-c", "echo $$"], procs), capture_output=True, text=True, check=True
    )
    assert procs.read_text().strip() == result.stdout.strip()  # exec kept the pid
    failed = subprocess.run(
        joined(["true"], tmp_path / "missing" / "cgroup.procs"), capture_output=True, text=True
    )
    assert failed.returncode == 126
    assert "cannot join the memory cgroup" in failed.stderr
