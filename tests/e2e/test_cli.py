"""CLI workflows: `ember serve` redeploys on save; `ember logs -f` follows."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

from harness import EMBER, Platform, wait_for

import ember

APP_V1 = """
import ember

@ember.endpoint(scaledown_window=60)
def version() -> dict:
    print("serving version call")
    return {"version": 1}
"""


def _reader(process: subprocess.Popen[str], lines: list[str]) -> threading.Thread:
    """A thread collecting the process's output lines until it ends."""

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _finish(process: subprocess.Popen[str], reader: threading.Thread) -> None:
    """Wait for the process and for its reader to see the end of its output, then close
    the pipe (closed under a reading thread, it would fail that thread)."""
    process.wait(30)
    reader.join(10)
    assert process.stdout is not None
    process.stdout.close()


def test_serve_redeploys_on_save_and_stops_on_ctrl_c(platform: Platform, tmp_path: Path) -> None:
    app_file = tmp_path / "live" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(APP_V1)
    serve = subprocess.Popen(
        [*EMBER, "serve", str(app_file), "--name", "live"],
        env=platform.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    serve_reader = _reader(serve, output)
    try:
        wait_for(lambda: any("watching" in line for line in output), 60)
        endpoint = ember.Endpoint.lookup("live", "version", config=platform.config())
        assert endpoint.call() == {"version": 1}

        follow = subprocess.Popen(
            [*EMBER, "logs", "live", "-f", "-n", "0"],
            env=platform.env,
            stdout=subprocess.PIPE,
            text=True,
        )
        followed: list[str] = []
        follow_reader = _reader(follow, followed)
        try:
            # A call's line shows the follow has begun: a process started on a loaded
            # machine can take longer to connect than ember serve takes to redeploy.
            def follow_began() -> bool:
                assert endpoint.call() == {"version": 1}
                time.sleep(0.5)  # replica output reaches the platform in batches
                return any("serving version call" in line for line in followed)

            wait_for(follow_began, 30)
            app_file.write_text(APP_V1.replace('{"version": 1}', '{"version": 2}'))
            wait_for(lambda: endpoint.call() == {"version": 2}, 60, interval=0.3)
            wait_for(lambda: any("deployed version 2" in line for line in followed), 15)
            deployed = next(i for i, line in enumerate(followed) if "deployed version 2" in line)
            wait_for(lambda: any("serving version call" in x for x in followed[deployed:]), 15)
        finally:
            follow.terminate()
            _finish(follow, follow_reader)
        assert any("redeploying" in line for line in output)
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            _finish(serve, serve_reader)
        except subprocess.TimeoutExpired:
            serve.kill()
            _finish(serve, serve_reader)
            raise AssertionError(
                "ember serve did not stop within 30 s of Ctrl+C; it said:\n" + "".join(output)
            ) from None
    assert any("stopped app live" in line for line in output)
    with platform.client() as client:
        assert client.post("/live--version/", json={}).status_code == 404


def test_history_lists_versions_and_rollback_serves_an_earlier_one_again(
    platform: Platform, tmp_path: Path
) -> None:
    app_file = tmp_path / "versioned" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(APP_V1)
    platform.deploy(app_file, "versioned")
    app_file.write_text(APP_V1.replace('"version": 1', '"version": 2'))
    platform.deploy(app_file, "versioned")
    endpoint = ember.Endpoint.lookup("versioned", "version", config=platform.config())
    wait_for(lambda: endpoint.call() == {"version": 2}, 60, interval=0.2)

    out = platform.ember("rollback", "versioned").stdout
    assert out.startswith("rolled versioned back to the code and settings of v1, deployed as v3")
    assert "versioned--version" in out  # its URL, as a deploy prints it
    # The serving version's replica answers until the new version's is ready.
    wait_for(lambda: endpoint.call() == {"version": 1}, 60, interval=0.2)
    out = platform.ember("rollback", "versioned", "2").stdout
    assert "of v2, deployed as v4" in out
    wait_for(lambda: endpoint.call() == {"version": 2}, 60, interval=0.2)

    rows = platform.ember("history", "versioned").stdout.splitlines()
    assert [row.split()[0] for row in rows] == ["VERSION", "v1", "v2", "v3", "v4"]
    assert "(as v1)" in rows[3] and "(as v2)" in rows[4]
    assert rows[4].endswith("serving") and "serving" not in rows[2]

    missing = platform.ember("rollback", "versioned", "9", check=False)
    assert missing.returncode == 1 and "has no version 9; it has 1, 2, 3, 4" in missing.stderr
    unknown = platform.ember("history", "nope", check=False)
    assert unknown.returncode == 1 and "no app named nope" in unknown.stderr
    bad = platform.ember("stop", "../tokens", check=False)
    assert bad.returncode == 2 and "app name '../tokens' is not allowed" in bad.stderr
    platform.ember("stop", "versioned")


JOB = """
import ember

@ember.endpoint()
def job(rows: int) -> dict:
    for row in range(rows):
        print(f"processed row {row}")
    return {"rows": rows}

@ember.endpoint()
def chunks(n: int):
    yield from (bytes([i]) * 3 for i in range(n))

@ember.endpoint()
def slow() -> None:
    import time
    print("working", flush=True)
    time.sleep(120)
"""


def test_run_deploys_calls_once_shows_output_and_stops(platform: Platform, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    # Modal's form, FILE.py::ENDPOINT, as a new user types it.
    done = platform.ember("run", f"{tmp_path / 'job.py'}::job", '{"rows": 3}')
    assert json.loads(done.stdout) == {"rows": 3}
    for row in range(3):  # the replica's output, as it ran
        assert f"processed row {row}" in done.stderr
    # A file stream, written where asked.
    target = tmp_path / "out.bin"
    platform.ember(
        "run", str(tmp_path / "job.py"), "chunks", '{"n": 2}', "--stream", "-o", str(target)
    )
    assert target.read_bytes() == b"\x00\x00\x00\x01\x01\x01"
    wrong = platform.ember("run", str(tmp_path / "job.py"), "nope", check=False)
    assert (
        wrong.returncode == 1
        and "has no endpoint 'nope' (it has: chunks, job, slow)" in wrong.stderr
    )
    unnamed = platform.ember("run", str(tmp_path / "job.py"), check=False)
    assert unnamed.returncode == 1 and "has 3 endpoints (chunks, job, slow): name one" in (
        unnamed.stderr
    )
    # Every run's app is gone again.
    wait_for(
        lambda: not any(e["label"].startswith("job-") for e in platform.status()["endpoints"]), 30
    )


def test_ctrl_c_stops_a_run_and_its_app(platform: Platform, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    run = subprocess.Popen(
        [*EMBER, "run", str(tmp_path / "job.py"), "slow"],
        env=platform.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # where the replica's output is shown
        text=True,
        # As a shell's background job starts it: SIGINT ignored, until `ember run` sets
        # its own handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    output: list[str] = []
    reader = _reader(run, output)
    try:
        wait_for(lambda: any("working" in line for line in output), 60)
        run.send_signal(signal.SIGINT)
        try:
            code = run.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                "ember run did not stop within 30 s of Ctrl+C; it said:\n" + "".join(output)
            ) from None
        assert code == 130, "".join(output)
    finally:
        if run.poll() is None:
            run.kill()
        _finish(run, reader)
    assert any("interrupted: stopping app job-" in line for line in output), "".join(output)
    wait_for(
        lambda: not any(e["label"].startswith("job-") for e in platform.status()["endpoints"]), 30
    )


FILES = """
import ember

@ember.endpoint()
def echo(text: str = "hi") -> dict:
    return {"text": text}

@ember.endpoint()
def png(n: int) -> ember.File:
    return ember.File(bytes(range(n)), media_type="image/png")

also_echo = echo  # another name for the same endpoint
"""


def _refused(result: subprocess.CompletedProcess[str], said: str) -> None:
    assert result.returncode == 1, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_what_the_cli_refuses_is_one_clear_line(platform: Platform, tmp_path: Path) -> None:
    app_file = tmp_path / "clear" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(FILES)
    platform.deploy(app_file, "clear")
    wait_for(lambda: platform.ember("call", "clear--echo", check=False).returncode == 0, 60)

    # Outputs that cannot be written, before anything is sent.
    nowhere = str(tmp_path / "no" / "out.bin")
    for args in (
        ("call", "clear--png", '{"n": 3}', "-o", nowhere),
        ("call", "clear--png", '{"n": 3}', "-o", str(tmp_path)),
        ("openapi", "clear--echo", "-o", nowhere),
    ):
        _refused(platform.ember(*args, check=False), "cannot write ")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"n": 2}\n{"n": 3}\n')
    _refused(
        platform.ember("map", "clear--png", str(inputs), "-o", nowhere, check=False), "cannot write"
    )
    # A file result in a map's JSON lines.
    lines = [
        json.loads(x)
        for x in platform.ember("map", "clear--png", str(inputs)).stdout.split("\n")
        if x
    ]
    assert lines[1] == {
        "index": 1,
        "file": {"base64": "AAEC", "size": 3, "media_type": "image/png"},
    }
    binary = tmp_path / "args.bin"
    binary.write_bytes(b"\xff\xd8\xff")
    _refused(platform.ember("call", "clear--echo", f"@{binary}", check=False), "not UTF-8 text")

    # Names that are not there.
    _refused(platform.ember("logs", "clear/nope", check=False), "app clear has no endpoint 'nope'")
    platform.ember("logs", "clear/png")  # one that is deployed still works
    _refused(platform.ember("node", "uncordon", "nope", check=False), "no worker node named nope")

    # Deploys that would have gone wrong later, or quietly.
    empty = platform.ember("deploy", str(app_file), "--name", "", check=False)
    _refused(empty, "app name '' is not allowed")
    (app_file.parent / ".emberignore").write_text("app.py\n")
    _refused(
        platform.ember("deploy", str(app_file), check=False), "leaves out app.py, the entry file"
    )
    (app_file.parent / ".emberignore").unlink()
    (app_file.parent / "helper.py").write_text("raise RuntimeError('no weights here')\n")
    app_file.write_text("import helper\n" + FILES)
    broken = platform.ember("deploy", str(app_file), check=False)
    assert broken.returncode == 1 and broken.stderr.startswith(f"ember: cannot import {app_file}:")
    assert "RuntimeError: no weights here" in broken.stderr and "ember/" not in broken.stderr
    _refused(platform.ember("serve", str(tmp_path / "nope.py"), check=False), "no such file")
    platform.ember("stop", "clear")
