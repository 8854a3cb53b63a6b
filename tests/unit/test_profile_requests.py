"""What `ember profile` may ask of a worker: py-spy's modes and formats, never a command of
the caller's, within bounds; and the py-spy command line the agent runs for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from machine_needs import need

from ember.cli.ops.profile import profile_format
from ember.wire import messages as wire
from ember_platform.core.replica_exec import check_profile
from ember_worker.agent.replicas.profiling import (
    in_pid_namespace_of,
    py_spy_command,
    recording_notes,
)


def test_a_profile_request_is_py_spy_s_own_options_only() -> None:
    request = check_profile({"duration": 2, "format": "speedscope", "native": False})
    assert request.profile == wire.ProfileSpec(duration=2.0, format="speedscope", native=False)
    assert request.command == ["py-spy", "record", "2 s", "speedscope"]
    assert check_profile({"mode": "dump"}).command == ["py-spy", "dump", "(native)"]
    for body, said in (
        ({"mode": "sh -c reboot"}, "mode is record or dump"),
        ({"duration": 0}, "duration"),
        ({"duration": 601}, "duration"),
        ({"format": "raw"}, "format flamegraph or speedscope"),
        ({"rate": 0}, "rate"),
        (["record"], "JSON object"),
    ):
        with pytest.raises(ValueError, match=said):
            check_profile(body)


def test_the_agent_s_py_spy_command() -> None:
    spec = wire.ProfileSpec(duration=2.5, rate=50)
    out = Path("/x/profile.svg")
    assert py_spy_command("py-spy", 42, spec, out, native=True) == [
        *("py-spy", "record", "--pid", "42", "--duration", "3", "--rate", "50"),
        *("--format", "flamegraph", "--output", "/x/profile.svg", "--subprocesses", "--native"),
    ]
    dump = wire.ProfileSpec(mode="dump")
    assert py_spy_command("py-spy", 7, dump, out, native=False) == [
        *("py-spy", "dump", "--pid", "7", "--subprocesses"),
    ]


def test_the_format_follows_the_output_s_name() -> None:
    assert profile_format(None, None) == "flamegraph"
    assert profile_format(None, Path("p.json")) == "speedscope"
    assert profile_format(None, Path("flame.svg")) == "flamegraph"
    assert profile_format("flamegraph", Path("p.json")) == "flamegraph"


def test_py_spy_joins_the_replica_s_pid_namespace() -> None:
    assert in_pid_namespace_of(os.getpid()) == ([], os.getpid())
    if shutil.which("unshare") is None or os.geteuid() != 0:
        need("root", "a PID namespace of its own needs root and util-linux's unshare")
    inside = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "30"])
    try:
        host_pid = _child_of(inside.pid)
        prefix, pid = in_pid_namespace_of(host_pid)
        assert pid == 1  # as the replica's own threads number themselves
        assert Path(prefix[0]).name == "nsenter" and prefix[1:5] == [
            "--target",
            str(host_pid),
            "--pid",
            "--",
        ]
        assert "--mount-proc" in prefix
    finally:
        inside.kill()
        inside.wait()


def _child_of(pid: int) -> int:
    """The process `unshare --fork` started (at once, or within 10 s on a loaded node)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("unshare started no child within 10 s")


def test_a_recording_s_notes_are_its_counts_and_how_far_behind_it_fell() -> None:
    progress = (
        "py-spy> Sampling process 100 times a second for 10 seconds. Press Control-C to exit.\n"
        "py-spy> 2.52s behind in sampling, results may be inaccurate. Try reducing the rate\n"
        "py-spy> 8.84s behind in sampling, results may be inaccurate. Try reducing the rate\n"
        "py-spy> Wrote flamegraph data to '/tmp/ember-profile-x/profile.svg'. Samples: 27972 "
        "Errors: 0\n"
    )
    assert recording_notes(progress) == (
        "8.84s behind in sampling, results may be inaccurate. Try reducing the rate\n"
        "py-spy: Samples: 27972 Errors: 0\n"
    )
    assert recording_notes("") == ""
