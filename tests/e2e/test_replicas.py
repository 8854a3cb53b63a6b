"""`ember replica ls | exec | stop`: the replicas one by one, a command run beside one,
and stopping one, through the CLI against a running platform."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
import websockets.sync.client
from harness import EMBER, Platform, wait_for

import ember
from ember.calling.tlsclient import client_context

APP = "inspected"
APP_SOURCE = """
import os

import ember


@ember.endpoint(scaledown_window=120, secrets=["inspected-keys"], cpu_limit=1)
def where() -> dict:
    pid = int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))  # the node's
    return {"pid": pid, "key": os.environ.get("API_KEY")}
"""


@pytest.fixture(scope="module")
def replica(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one replica of a deployed endpoint, as `ember replica ls --json` gives it."""
    app_file = tmp_path_factory.mktemp("inspected") / "app.py"
    app_file.write_text(APP_SOURCE)
    platform.ember("secret", "set", "inspected-keys", "API_KEY=sesame")
    platform.deploy(app_file, APP)
    first = ember.Endpoint.lookup(APP, "where", config=platform.config()).call()
    rows = json.loads(platform.ember("replica", "ls", APP, "--json").stdout)
    assert len(rows) == 1
    return {**rows[0], "host_pid": first["pid"]}


def _processes_with(marker: str, but: int) -> list[int]:
    """PIDs of this machine's processes whose command line holds `marker`, but `but`'s
    (the CLI that asked for it to run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != but:
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_ls_lists_each_replica_with_its_endpoint_node_and_start(
    platform: Platform, replica: dict
) -> None:
    assert replica["label"] == f"{APP}--where" and replica["state"] == "ready"
    assert replica["node"] and replica["served"] == 1 and replica["start_kind"] == "cold"
    listing = platform.ember("replica", "ls").stdout
    header, row = (
        listing.splitlines()[0],
        next(line for line in listing.splitlines() if line.startswith(replica["id"])),
    )
    assert header.split()[:5] == ["REPLICA", "ENDPOINT", "VER", "NODE", "STATE"]
    assert f"{APP}--where" in row and "ready" in row and "cold" in row
    assert (
        "no replicas of app nothing-here" in platform.ember("replica", "ls", "nothing-here").stdout
    )


def test_exec_runs_in_the_replicas_folder_and_environment(
    platform: Platform, replica: dict
) -> None:
    script = (
        "import json, os, sys; print(json.dumps({'cwd': os.getcwd(), "
        "'files': sorted(os.listdir()), 'key': os.environ.get('API_KEY'), "
        "'pid': os.environ['EMBER_REPLICA_PID'], 'python': sys.executable, "
        "'cgroup': open('/proc/self/cgroup').read()}))"
    )
    prefix = replica["id"][:6]  # the first characters of an id do, if only one has them
    result = platform.ember("replica", "exec", prefix, "--", "python", "-c", script)
    seen = json.loads(result.stdout)
    assert "app.py" in seen["files"]  # the deployed bundle
    assert seen["key"] == "sesame"  # its secret's variables
    assert int(seen["pid"]) == replica["host_pid"]  # the replica's process, for py-spy
    assert Path(seen["python"]).parent == Path(EMBER[0]).parent  # its app's Python first
    assert replica["id"] in seen["cgroup"]  # within its cpu_limit=
    # Standard error apart, and the command's exit status is the CLI's.
    failed = platform.ember(
        "replica",
        "exec",
        replica["id"],
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 3",
        check=False,
    )
    assert (failed.returncode, failed.stdout, failed.stderr) == (3, "out\n", "err\n")
    missing = platform.ember("replica", "exec", replica["id"], "--", "no-such-tool", check=False)
    assert missing.returncode == 127 and "no-such-tool" in missing.stderr
    # With -i, the command reads what this one is given: a script for `python -`.
    piped = subprocess.run(
        [*EMBER, "replica", "exec", replica["id"], "-i", "--", "python", "-"],
        input="import os\nprint('piped', os.environ['API_KEY'])\n",
        env=platform.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (piped.returncode, piped.stdout) == (0, "piped sesame\n"), piped.stderr
    # An endpoint's label stands for its oldest ready replica.
    by_label = platform.ember("replica", "exec", f"{APP}--where", "--", "sh", "-c", "echo $PWD")
    assert by_label.stdout.strip() == seen["cwd"]
    # The platform's log says what was run, where, and how it ended.
    logs = platform.ember("logs", APP, "-n", "200").stdout
    assert ": sh -c echo out; echo err >&2; exit 3" in logs
    assert re.search(r"exec x-[0-9a-f]+ exited 3 after [0-9.]+ s", logs), logs


def test_exec_refuses_what_it_cannot_run(platform: Platform, replica: dict) -> None:
    unknown = platform.ember("replica", "exec", "r-nonesuch", "--", "true", check=False)
    assert unknown.returncode == 1 and "no replica r-nonesuch is running" in unknown.stderr
    bare = platform.ember("replica", "exec", replica["id"], check=False)
    assert bare.returncode == 1 and "name the command to run" in bare.stderr
    with platform.client() as client:
        url = f"/v1/replicas/{replica['id']}/exec"
        for body, needle in (
            ({"command": []}, "non-empty list of strings"),
            ({"command": ["ls"], "timeout": -1}, '"timeout" must be a number'),
            ([1, 2], "must be a JSON object"),
        ):
            response = client.post(url, json=body)
            assert response.status_code == 400 and needle in response.json()["error"]["message"]
        invoke = platform.ember("token", "create", "--scope", "invoke").stdout.split()[-1]
        with platform.client(token=invoke) as caller:
            assert caller.post(url, json={"command": ["true"]}).status_code == 403
            assert caller.get("/v1/replicas").status_code == 403
    # The WebSocket of -i and -t says why it refuses, too.
    socket_url = platform.url.replace("https://", "wss://") + url
    for token, needle in ((invoke, "needs a deploy token"), (platform.token, "no replica r-x")):
        target = socket_url.replace(replica["id"], "r-x") if "r-x" in needle else socket_url
        with websockets.sync.client.connect(
            target,
            ssl=client_context(platform.ca),
            additional_headers={"Authorization": f"Bearer {token}"},
        ) as connection:
            connection.send(json.dumps({"command": ["true"], "interactive": True}))
            refusal = json.loads(connection.recv(timeout=30))
        assert refusal["exit_code"] is None and needle in refusal["error"]


def _read_terminal(master: int, process: subprocess.Popen[bytes], timeout: float) -> bytes:
    """What the CLI wrote to its terminal until it exited (or `timeout` passed)."""
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end closed
                break
            if not chunk:
                break
            output += chunk
        elif process.poll() is not None:
            break
    return output


def test_exec_with_a_terminal_runs_what_is_typed_at_it(platform: Platform, replica: dict) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 90, 0, 0))
    cli = subprocess.Popen(
        [*EMBER, "replica", "exec", replica["id"], "-t", "--", "sh"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=platform.env,
        start_new_session=True,
    )
    os.close(slave)
    try:
        os.write(master, b"stty size; echo marker-$((6 * 7)) $API_KEY; exit 3\r")
        output = _read_terminal(master, cli, 60)
        cli.wait(30)
    finally:
        if cli.poll() is None:
            cli.kill()
        os.close(master)
    assert b"30 90" in output, output  # the window's size, on the replica's side
    assert b"marker-42 sesame" in output, output  # run by a shell with its environment
    assert cli.returncode == 3, output


def _sleeping_exec(platform: Platform, replica: dict, marker: str) -> subprocess.Popen[str]:
    """`ember replica exec` of a long sleep whose command line holds `marker`, once the
    sleep runs beside the replica."""
    caller = subprocess.Popen(
        [*EMBER, "replica", "exec", replica["id"], "--", "sh", "-c", f"sleep 300 # {marker}"],
        env=platform.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: _processes_with(marker, caller.pid), 30)
    return caller


def test_exec_timeout_and_a_caller_who_leaves_end_the_command(
    platform: Platform, replica: dict
) -> None:
    timed = platform.ember(
        "replica", "exec", replica["id"], "--timeout", "1", "--", "sleep", "30", check=False
    )
    assert timed.returncode == 124 and "timeout of 1 s" in timed.stderr
    # A caller interrupted mid-command: the command (and what it started) is killed.
    marker = f"ember-exec-marker-{os.getpid()}"
    caller = _sleeping_exec(platform, replica, marker)
    caller.terminate()
    caller.communicate(timeout=10)
    wait_for(lambda: not _processes_with(marker, caller.pid), 30)


def test_stop_replaces_a_replica_and_ends_its_commands(platform: Platform, replica: dict) -> None:
    marker = f"ember-exec-stopped-{os.getpid()}"
    running = _sleeping_exec(platform, replica, marker)
    stopped = platform.ember("replica", "stop", replica["id"], "--now").stdout
    assert "was killed" in stopped
    _, stderr = running.communicate(timeout=30)
    assert running.returncode == 1 and "ended, and the command with it" in stderr
    assert not _processes_with(marker, running.pid)
    # The next call gets a new replica.
    again = ember.Endpoint.lookup(APP, "where", config=platform.config()).call()
    assert again["pid"] != replica["host_pid"]
    rows = json.loads(platform.ember("replica", "ls", APP, "--json").stdout)
    assert [r["id"] for r in rows] != [replica["id"]]
    # A graceful stop: it finishes and goes; `ember replica ls` no longer shows it.
    newer = next(r for r in rows if r["state"] == "ready")
    assert "is stopping" in platform.ember("replica", "stop", newer["id"]).stdout
    wait_for(
        lambda: (
            newer["id"]
            not in {r["id"] for r in json.loads(platform.ember("replica", "ls", "--json").stdout)}
        ),
        30,
    )
