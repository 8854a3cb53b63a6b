"""The library replicas in PID namespaces preload: /proc paths naming their own threads
by the ids they see resolve to those threads (CUDA's cuInit opens such a path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from machine_needs import need

from ember_worker.processes import procfs_tid
from ember_worker.processes.process_env import ENV_FD_OPTION, env_file
from ember_worker.processes.replica_processes import in_pid_namespace

# Names a helper thread, then opens /proc paths by the ids this process sees, as a
# native library would: its own thread through fopen(3), another thread and its own pid
# through open(2).
PROBE = r"""
import ctypes, json, os, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.fopen.restype = ctypes.c_void_p
seen = {}
named, done = threading.Event(), threading.Event()

def helper():
    libc.prctl(15, b"probe-helper")  # PR_SET_NAME
    stream = libc.fopen(f"/proc/self/task/{threading.get_native_id()}/comm".encode(), b"r")
    seen["own thread"] = bool(stream)
    if stream:
        libc.fclose(ctypes.c_void_p(stream))
    named.set()
    done.wait()

thread = threading.Thread(target=helper)
thread.start()
named.wait()
try:
    with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
        seen["other thread"] = comm.read().strip()
except OSError as exc:
    seen["other thread"] = type(exc).__name__
with open(f"/proc/{os.getpid()}/status") as status:
    seen["own pid"] = dict(line.split(":\t", 1) for line in status.read().splitlines())["Tgid"]
with open("/proc/self/status") as status:
    seen["self"] = dict(line.split(":\t", 1) for line in status.read().splitlines())["Tgid"]
done.set()
thread.join()
seen["pid"] = os.getpid()
print(json.dumps(seen))
"""


@pytest.fixture
def needs_root() -> None:
    if os.geteuid() != 0:
        need("root", "PID namespaces need root")


def _probe(env: dict[str, str], *, pid_namespace: bool) -> dict[str, object]:
    command = [sys.executable, "-c", PROBE]
    if not pid_namespace:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    else:  # the probe's environment as the agent hands a replica its own: a memory file
        env_fd = env_file(env)
        try:
            command = [*in_pid_namespace(), ENV_FD_OPTION, str(env_fd), *command]
            done = subprocess.run(
                command, pass_fds=(env_fd,), capture_output=True, text=True, timeout=60
            )
        finally:
            os.close(env_fd)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _built() -> None:
    if procfs_tid.library() is None:
        pytest.fail(f"{procfs_tid.LIBRARY} is not built: run infra/native.sh")


@pytest.mark.usefixtures("needs_root")
def test_without_the_library_a_pid_namespace_hides_its_own_threads() -> None:
    """Why the library exists: the node's /proc knows the threads by other ids."""
    env = {k: v for k, v in os.environ.items() if k != procfs_tid.PRELOAD_ENV}
    seen = _probe(env, pid_namespace=True)
    assert seen["pid"] == 1
    assert seen["own thread"] is False
    assert seen["other thread"] == "FileNotFoundError"
    assert seen["own pid"] != seen["self"]  # /proc/1 is the node's init


@pytest.mark.usefixtures("needs_root")
def test_with_the_library_a_pid_namespace_opens_its_own_threads() -> None:
    _built()
    seen = _probe(procfs_tid.with_preload(dict(os.environ)), pid_namespace=True)
    assert seen["pid"] == 1
    assert seen["own thread"] is True
    assert seen["other thread"] == "probe-helper"
    assert seen["own pid"] == seen["self"]


def test_outside_a_pid_namespace_the_library_changes_nothing() -> None:
    _built()
    seen = _probe(procfs_tid.with_preload(dict(os.environ)), pid_namespace=False)
    assert seen["own thread"] is True
    assert seen["other thread"] == "probe-helper"
    assert seen["own pid"] == seen["self"] == str(seen["pid"])


def test_the_library_goes_first_in_ld_preload_once() -> None:
    _built()
    library = str(procfs_tid.LIBRARY)
    env = procfs_tid.with_preload({"LD_PRELOAD": "/opt/other.so"})
    assert env["LD_PRELOAD"] == f"{library}:/opt/other.so"
    assert procfs_tid.with_preload(env) == env
    assert procfs_tid.with_preload({})["LD_PRELOAD"] == library
