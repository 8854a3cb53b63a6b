"""The environments the agent gives the processes it starts (process_env.py): a
replica's built from nothing but Ember's base and the names an operator hands on, the
tenant's carried to a child as a memory file, and system tools never found on a PATH a
tenant set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ember_worker.processes.process_env import (
    REPLICA_BASE,
    check_passed_name,
    env_file,
    read_env_file,
    replica_base,
    system_tool,
)


def test_a_replicas_base_holds_only_the_names_handed_on() -> None:
    node = {"AWS_SECRET_ACCESS_KEY": "s3", "COVERAGE_PROCESS_CONFIG": "{}", "PATH": "/evil"}
    assert replica_base((), node) == REPLICA_BASE
    passed = replica_base(("COVERAGE_PROCESS_CONFIG", "NOT_SET"), node)
    assert passed == {**REPLICA_BASE, "COVERAGE_PROCESS_CONFIG": "{}"}


@pytest.mark.parametrize("name", ["EMBER_WORKER_TOKEN", "EMBER_TOKEN", "A B", "1X", ""])
def test_the_workers_credentials_and_non_names_are_never_handed_on(name: str) -> None:
    with pytest.raises(ValueError):
        check_passed_name(name)
    assert check_passed_name("HF_HOME") == "HF_HOME"


def test_an_environment_travels_whole_as_a_memory_file_to_a_child() -> None:
    env = {"LD_PRELOAD": "/x.so", "BIG": "v" * 300_000, "EMPTY": ""}  # past a pipe's buffer
    fd = env_file(env)
    try:
        script = "import json, sys; from ember_worker.processes.process_env import read_env_file;"
        script += " print(json.dumps(read_env_file(int(sys.argv[1]))))"
        done = subprocess.run(
            [sys.executable, "-c", script, str(fd)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin", "PYTHONPATH": os.pathsep.join(sys.path)},
            check=True,
        )
    finally:
        os.close(fd)
    assert done.stdout.strip() == __import__("json").dumps(env)


def test_a_file_that_holds_no_environment_is_refused() -> None:
    read, write = os.pipe()
    os.write(write, b'{"A=B": "x"}')
    os.close(write)
    with pytest.raises(ValueError):
        read_env_file(read)


def test_system_tools_come_from_the_systems_folders_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nowhere")
    assert system_tool("env").startswith(("/usr/bin/", "/bin/"))
    with pytest.raises(FileNotFoundError, match="not installed"):
        system_tool("no-such-tool-here")
