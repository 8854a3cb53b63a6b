"""CLI workflows: `ember serve` redeploys on save; `ember logs -f` follows."""

from __future__ import annotations

import signal
import subprocess
import threading
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
            app_file.write_text(APP_V1.replace('{"version": 1}', '{"version": 2}'))
            wait_for(lambda: endpoint.call() == {"version": 2}, 60, interval=0.3)
            wait_for(lambda: any("deployed version 2" in line for line in followed), 15)
            wait_for(lambda: any("serving version call" in line for line in followed), 15)
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
    assert endpoint.call() == {"version": 2}

    out = platform.ember("rollback", "versioned").stdout
    assert out.startswith("rolled versioned back to the code and settings of v1, deployed as v3")
    assert "versioned--version" in out  # its URL, as a deploy prints it
    assert endpoint.call() == {"version": 1}
    out = platform.ember("rollback", "versioned", "2").stdout
    assert "of v2, deployed as v4" in out
    assert endpoint.call() == {"version": 2}

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
