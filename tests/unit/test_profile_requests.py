"""What `ember profile` may ask of a worker: py-spy's modes and formats, never a command of
the caller's, within bounds; and the py-spy command line the agent runs for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.cli.ops.profile import profile_format
from ember.wire import messages as wire
from ember_platform.core.replica_exec import check_profile
from ember_worker.agent.replicas.profiling import py_spy_command


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
