"""Replica cgroups: finding where to make them (v1, v2), memory, CPU and pids limits,
OOM counts and CPU throttling."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from ember_worker.processes.cgroups import (
    CPU,
    MEMORY,
    PIDS,
    CgroupTree,
    CpuThrottling,
    ReplicaCgroup,
    cpu_quota_us,
    find_tree,
    joined,
)

MIB = 1024 * 1024


def fake_v1(root: Path) -> tuple[Path, Path, Path, Path]:
    """A cgroup v1 layout under `root`: (mounts file, cgroup file, the agent's memory
    group, its cpu group), cpu and cpuacct sharing a hierarchy as systemd mounts them."""
    memory = root / "sys/fs/cgroup/memory"
    cpu = root / "sys/fs/cgroup/cpu,cpuacct"
    group = memory / "jobs/agent"
    group.mkdir(parents=True)
    cpu_group = cpu / "system.slice"
    cpu_group.mkdir(parents=True)
    mounts = root / "mounts"
    mounts.write_text(
        f"tmpfs {root}/sys/fs/cgroup tmpfs rw 0 0\n"
        f"cgroup {cpu} cgroup rw,cpu,cpuacct 0 0\n"
        f"cgroup {root}/sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n"
        f"cgroup {memory} cgroup rw,relatime,memory 0 0\n"
    )
    cgroups = root / "cgroup"
    cgroups.write_text("6:cpuset:/\n5:cpu,cpuacct:/system.slice\n4:memory:/jobs/agent\n0::/\n")
    return mounts, cgroups, group, cpu_group


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


def test_v1_tree_goes_under_the_agents_group_in_each_hierarchy(tmp_path: Path) -> None:
    mounts, cgroups, group, cpu_group = fake_v1(tmp_path)
    stale = group / "ember-999999999"  # a PID no process has: its agent is gone
    (stale / "r-old").mkdir(parents=True)
    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=42)
    bases = {MEMORY: group / "ember-42", CPU: cpu_group / "ember-42"}
    assert tree == CgroupTree(1, bases, {PIDS: "no pids cgroup controller is mounted"})
    assert tree.problem(MEMORY) is None and tree.problem(CPU) is None
    assert tree.bases[MEMORY].is_dir() and not stale.exists()
    # Replicas together weigh a quarter of one of the node's processes for the CPU.
    assert (cpu_group / "ember-42/cpu.shares").read_text() == "256"
    replica = tree.create("r-1", memory_mib=300)
    # A cpu group of its own all the same, without cpu_limit=: it shares under that weight.
    cpu_dir = cpu_group / "ember-42/r-1"
    assert replica == ReplicaCgroup(1, group / "ember-42/r-1", cpu_dir, 300, None)
    assert (group / "ember-42/r-1/memory.limit_in_bytes").read_text() == str(300 * MIB)
    assert replica.procs_files == [group / "ember-42/r-1/cgroup.procs", cpu_dir / "cgroup.procs"]
    assert not (cpu_dir / "cpu.cfs_quota_us").exists()
    assert replica.oom_kills() == 0  # no counter file: nothing known
    assert replica.cpu_throttling() is None  # no cpu_limit=
    (group / "ember-42/r-1/memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    )
    assert replica.oom_kills() == 2


def test_v1_cpu_limit_is_a_quota_in_the_cpu_hierarchy(tmp_path: Path) -> None:
    mounts, cgroups, group, cpu_group = fake_v1(tmp_path)
    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=43)
    both = tree.create("r-9", memory_mib=64, cpu_limit=0.5)
    cpu_dir = cpu_group / "ember-43/r-9"
    assert both.paths == [group / "ember-43/r-9", cpu_dir]
    assert both.procs_files == [p / "cgroup.procs" for p in both.paths]
    assert (cpu_dir / "cpu.cfs_period_us").read_text() == "100000"
    assert (cpu_dir / "cpu.cfs_quota_us").read_text() == "50000"
    assert both.cpu_throttling() == CpuThrottling(0, 0, 0.0)  # no stat file yet
    (cpu_dir / "cpu.stat").write_text("nr_periods 40\nnr_throttled 10\nthrottled_time 2500000000\n")
    throttling = both.cpu_throttling()
    assert throttling == CpuThrottling(40, 10, 2.5)
    line = throttling.describe(0.5)
    assert line is not None and "cpu_limit=0.5 held it back in 25 %" in line
    assert "2.5 s" in line
    assert CpuThrottling(40, 0, 0.0).describe(0.5) is None  # never held back: nothing said


def test_cpu_quotas_are_shares_of_a_100_ms_period() -> None:
    assert cpu_quota_us(2) == 200_000
    assert cpu_quota_us(0.25) == 25_000
    assert cpu_quota_us(0.001) == 1_000  # the kernel's least


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
    bases = {c: group / "ember-7" for c in (MEMORY, CPU, PIDS)}
    # The egress rule's group (egress_rules.py) is the same one, named from the v2 root.
    egress = str((group / "ember-7").relative_to(tmp_path / "sys/fs/cgroup"))
    assert tree == CgroupTree(2, bases, {}, group / "ember-7", egress)
    assert writes == [
        ("cgroup.subtree_control", "+memory"),
        ("ember-agent/cgroup.procs", "101"),
        ("ember-agent/cgroup.procs", "102"),
        ("cgroup.subtree_control", "+memory"),
        ("ember-7/cgroup.subtree_control", "+memory"),
        ("cgroup.subtree_control", "+cpu"),  # the parent is empty now: no EBUSY
        ("ember-7/cgroup.subtree_control", "+cpu"),
        ("ember-7/cpu.weight", "25"),  # replicas together: a quarter of a process's group
        ("cgroup.subtree_control", "+pids"),
        ("ember-7/cgroup.subtree_control", "+pids"),
    ]
    base = group / "ember-7"
    swap = base / "r-2" / "memory.swap.max"
    swap.parent.mkdir()
    swap.write_text("max")
    replica = tree.create("r-2", memory_mib=128, cpu_limit=1.5)
    assert replica.paths == [base / "r-2"]  # one directory for both controllers
    assert (base / "r-2/memory.max").read_text() == str(128 * MIB)
    assert swap.read_text() == "0"
    assert (base / "r-2/cpu.max").read_text() == "150000 100000"
    (base / "r-2/memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    assert replica.oom_kills() == 1
    (base / "r-2/cpu.stat").write_text(
        "usage_usec 9\nnr_periods 8\nnr_throttled 2\nthrottled_usec 300000\n"
    )
    assert replica.cpu_throttling() == CpuThrottling(8, 2, 0.3)
    capped = tree.create("r-3", pids_max=4096)  # every replica's cap on its processes
    assert capped.paths == [base / "r-3"] and capped.pids_max == 4096
    assert (base / "r-3/pids.max").read_text() == "4096"


def test_where_there_can_be_no_limits_says_why(tmp_path: Path) -> None:
    mounts, cgroups, group = fake_v2(tmp_path)
    (group / "cgroup.controllers").write_text("cpu pids\n")
    (group / "cgroup.procs").write_text("")
    found = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=1)
    assert found.problem(MEMORY) == (
        "cgroup v2 gives /system.slice/ember.service no memory controller"
    )
    assert found.problem(CPU) is None and set(found.bases) == {CPU, PIDS}
    mounts.write_text("proc /proc proc rw 0 0\n")
    nothing = find_tree(mounts_file=mounts, cgroup_file=cgroups)
    assert nothing.bases == {}
    assert nothing.problem(CPU) == "no memory or cpu cgroup controller is mounted"
    missing = find_tree(mounts_file=tmp_path / "nope", cgroup_file=cgroups)
    problem = missing.problem(MEMORY)
    assert problem is not None and problem.startswith("cannot read this process's cgroups")
    assert CgroupTree.unavailable("not root").problem(CPU) == "not root"


def test_v1_without_a_cpu_hierarchy_limits_memory_alone(tmp_path: Path) -> None:
    mounts, cgroups, _, _ = fake_v1(tmp_path)
    mounts.write_text(
        "\n".join(line for line in mounts.read_text().splitlines() if "cpu," not in line)
    )
    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=44)
    assert set(tree.bases) == {MEMORY}
    assert tree.problem(CPU) == "no cpu cgroup controller is mounted"


def test_a_refused_limit_leaves_no_group_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Path.write_text

    def refuse_limits(path: Path, text: str) -> int:
        if path.name == "memory.limit_in_bytes":  # as the kernel answers a bad figure
            raise OSError(errno.EINVAL, "Invalid argument")
        return original(path, text)

    monkeypatch.setattr(Path, "write_text", refuse_limits)
    tree = CgroupTree(1, {MEMORY: tmp_path / "memory/ember-5", CPU: tmp_path / "cpu/ember-5"})
    for base in tree.bases.values():
        base.mkdir(parents=True)
    with pytest.raises(OSError, match="Invalid argument"):
        tree.create("r-3", memory_mib=64, cpu_limit=1)
    assert not (tmp_path / "memory/ember-5/r-3").exists()
    assert not (tmp_path / "cpu/ember-5/r-3").exists()  # made first, removed with the other
    tree.remove()
    assert not any(base.exists() for base in tree.bases.values())


def test_removing_a_replica_group_waits_for_it_to_empty(tmp_path: Path) -> None:
    replica = ReplicaCgroup(1, tmp_path / "r-4", None, 64)
    path = tmp_path / "r-4"
    path.mkdir()
    assert replica.remove() and not path.exists()
    assert replica.remove()  # already gone
    (path / "busy").mkdir(parents=True)  # not EBUSY: no retrying
    assert not replica.remove(attempts=3)


def test_joined_runs_the_command_after_writing_its_pid_to_each_group(tmp_path: Path) -> None:
    procs = [tmp_path / "memory.procs", tmp_path / "cpu.procs"]
    result = subprocess.run(
        joined(["sh", "-c", "echo $$ $0 $1", "a b", "c"], procs),
        capture_output=True,
        text=True,
        check=True,
    )
    pid, args = result.stdout.split(maxsplit=1)
    assert [p.read_text().strip() for p in procs] == [pid, pid]  # exec kept the pid
    assert args.strip() == "a b c"  # the command's own arguments are untouched
    assert joined(["true"], []) == ["true"]
    failed = subprocess.run(
        joined(["true"], [procs[0], tmp_path / "missing" / "cgroup.procs"]),
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 126
    assert "cannot join the cgroup" in failed.stderr


def test_v1_pids_hierarchy_caps_each_replicas_processes(tmp_path: Path) -> None:
    mounts, cgroups, _, _ = fake_v1(tmp_path)
    pids = tmp_path / "sys/fs/cgroup/pids"
    pids.mkdir()
    mounts.write_text(mounts.read_text() + f"cgroup {pids} cgroup rw,pids 0 0\n")
    cgroups.write_text(cgroups.read_text() + "8:pids:/\n")
    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=45)
    assert tree.problem(PIDS) is None and tree.bases[PIDS] == pids / "ember-45"
    replica = tree.create("r-9", pids_max=64)
    cpu_dir = tree.bases[CPU] / "r-9"  # its CPU weight's group
    assert replica.paths == [cpu_dir, pids / "ember-45/r-9"]
    assert (pids / "ember-45/r-9/pids.max").read_text() == "64"
    assert replica.procs_files == [cpu_dir / "cgroup.procs", pids / "ember-45/r-9/cgroup.procs"]


def test_a_v1_node_with_the_unified_hierarchy_gives_each_replica_a_v2_group_too(
    tmp_path: Path,
) -> None:
    """The link-local egress rule matches replicas by their cgroup v2 group (iptables'
    cgroup --path): on a v1 node the agent makes those groups in the unified hierarchy,
    controllers or not, and the sandbox shows each controller's group under /sys."""
    mounts, cgroups, group, cpu_group = fake_v1(tmp_path)
    unified = tmp_path / "sys/fs/cgroup/unified"
    unified.mkdir()
    with mounts.open("a") as more:
        more.write(f"cgroup2 {unified} cgroup2 rw,nsdelegate 0 0\n")
    stale = unified / "ember-999999999/r-old"  # an agent that is gone
    stale.mkdir(parents=True)
    tree = find_tree(mounts_file=mounts, cgroup_file=cgroups, pid=42)
    assert (tree.egress_base, tree.egress_path) == (unified / "ember-42", "ember-42")
    assert not stale.parent.exists()
    replica = tree.create("r-1", memory_mib=300, cpu_limit=0.5)
    assert replica.procs_files == [
        group / "ember-42/r-1/cgroup.procs",
        cpu_group / "ember-42/r-1/cgroup.procs",
        unified / "ember-42/r-1/cgroup.procs",
    ]
    assert replica.views() == [
        (group / "ember-42/r-1", "/sys/fs/cgroup/memory"),
        (cpu_group / "ember-42/r-1", "/sys/fs/cgroup/cpu"),
    ]
    replica.remove(attempts=1)  # (the fake memory group holds files: cgroupfs would not)
    assert not (unified / "ember-42/r-1").exists()
