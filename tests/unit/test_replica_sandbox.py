"""A replica's sandbox plan shows it what it needs and nothing of the worker's, and its
seccomp filter refuses what Docker's default profile refuses (run in a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember_worker.agent.config import AgentConfig
from ember_worker.agent.replicas.sandboxes import (
    TMP_BYTES,
    WRITABLE_ENV,
    ReplicaSandboxes,
    mount_key,
)
from ember_worker.processes import seccomp_filter
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME, WORKER_INSIDE, SandboxPlan


def test_a_plan_mounts_its_own_things_and_nothing_of_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(WRITABLE_ENV, raising=False)  # a test run's shared folders
    work = tmp_path / "worker"
    config = AgentConfig("https://cp", "t", None, work, "node", 1.0, 1024)
    sandboxes = ReplicaSandboxes(config)
    sandboxes.prepare_node()
    bundle = work / "bundles" / "sha256-abc"
    bundle.mkdir(parents=True)
    (work / "volumes" / "shop").mkdir(parents=True)
    config.weights_dir.mkdir()
    home = work / "replicas" / "r-1"
    home.mkdir(parents=True)
    plan = sandboxes.prepare(
        replica_id="r-1",
        app_key="shop",
        bundle_dir=bundle,
        runtime=[Path(sys.base_prefix), Path(sys.prefix)],
        home=home,
    )
    try:
        _check_plan(sandboxes, plan, work, home)
    finally:  # its scratch tmpfs is mounted on the node
        sandboxes.release("r-1")
    assert not Path(plan.root).exists() and not Path(plan.scratch).exists()


def _check_plan(sandboxes: ReplicaSandboxes, plan: SandboxPlan, work: Path, home: Path) -> None:
    bundle = work / "bundles" / "sha256-abc"
    targets = {m.target: m for m in plan.mounts}
    writable = {m.target for m in plan.mounts if m.writable and not m.device}
    # The worker's folder is at one path inside on every node, whatever its path here.
    assert writable == {
        f"{WORKER_INSIDE}/volumes/shop",
        f"{WORKER_INSIDE}/weights",
        SANDBOX_HOME,
        "/tmp",
        "/dev/shm",
    }
    # /tmp and /dev/shm: a tmpfs of the replica's own, its size the limit.
    assert targets["/tmp"].source == f"{plan.scratch}/tmp"
    assert os.statvfs(plan.scratch).f_blocks * os.statvfs(plan.scratch).f_frsize == TMP_BYTES
    assert {m.target for m in plan.mounts if m.device} >= {"/dev/null", "/dev/urandom"}
    assert targets[SANDBOX_HOME].source == str(home)
    assert targets[f"{WORKER_INSIDE}/bundles/sha256-abc"].source == str(bundle)
    assert plan.cwd == f"{WORKER_INSIDE}/bundles/sha256-abc"
    assert plan.on_node(plan.cwd) == str(bundle) and plan.inside(bundle) == plan.cwd
    assert not any(t.startswith(str(work)) for t in targets)
    # Its /etc: the loader's cache and the like, copied; never the node's shadow file.
    etc = Path(targets["/etc"].source)
    assert (etc / "ld.so.cache").exists() and not (etc / "shadow").exists()
    assert "/usr" in targets
    assert all(m.key == mount_key(m.target) for m in plan.mounts)
    # The plan file is root's alone and reads back the same.
    saved = sandboxes.plan_path("r-1")
    assert saved.stat().st_mode & 0o777 == 0o600
    assert SandboxPlan.from_bytes(saved.read_bytes()) == plan
    # Its root folder: mount points, and folders above them that can be passed, not listed.
    root = Path(plan.root)
    assert (root / plan.cwd.lstrip("/")).is_dir()
    assert (root / "tmp").is_dir() and (root / "proc").is_dir()
    assert (root / WORKER_INSIDE.lstrip("/")).stat().st_mode & 0o777 == 0o711


CHILD = """
import ctypes, errno, json, os, sys
from ember_worker.processes import seccomp_filter
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(38, 1, 0, 0, 0)  # no_new_privs, as the init script sets it
seccomp_filter.install()
def errno_of(result):
    return "ok" if result == 0 else errno.errorcode[ctypes.get_errno()]
seen = {
    "unshare": errno_of(libc.unshare(0x10000000)),
    "mount": errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "ptrace": errno_of(libc.ptrace(16, os.getppid(), 0, 0)),
    "keyctl": errno_of(libc.syscall(250, 0, 0, 0, 0, 0)),
    "clone newuser": errno_of(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)),
}
pid = os.fork()  # plain forks and threads still work
if pid == 0:
    os._exit(7)
seen["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(seen))
"""


def test_the_filter_refuses_namespaces_mounts_ptrace_and_keys() -> None:
    assert seccomp_filter.available() is None
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "unshare": "EPERM",
        "mount": "EPERM",
        "ptrace": "EPERM",
        "keyctl": "EPERM",
        "clone newuser": "EPERM",
        "fork": 7,
    }
