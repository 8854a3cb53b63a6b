"""`ember server` as a user stops it (Ctrl+C), and the API's answers to paths it lacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import EMBER, Platform, running_platform, wait_for

APP = """
import ember

@ember.endpoint()
def hello() -> dict:
    return {"hello": "world"}


@ember.endpoint()
def slow() -> dict:
    import time

    time.sleep(120)
    return {"slept": 120}
"""


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("platform")) as running:
        yield running


def _collect(process: subprocess.Popen[str], lines: list[str]) -> threading.Thread:
    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_with_a_log_follower_stops_promptly_and_leaves_the_worker_stopped(
    tmp_path: Path,
) -> None:
    (tmp_path / "app.py").write_text(APP)
    with running_platform(tmp_path / "platform") as platform:
        platform.deploy(tmp_path / "app.py", "followed")
        follower = subprocess.Popen(
            [*EMBER, "logs", "followed", "-f"],
            env=platform.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        followed: list[str] = []
        reader = _collect(follower, followed)
        try:
            # Its history's line arrives once the follow has begun.
            wait_for(lambda: any("deployed version 1" in line for line in followed), 30)
            assert platform.process is not None
            # As a terminal's Ctrl+C does: the server and its local worker get SIGINT.
            os.killpg(platform.process.pid, signal.SIGINT)
            code = platform.process.wait(30)
            follower_code = follower.wait(10)
        finally:
            if follower.poll() is None:
                follower.kill()
            follower.wait()
            reader.join(10)
            assert follower.stdout is not None
            follower.stdout.close()
        said = "\n".join(platform.output)
        assert code == 130, said  # stopped by SIGINT, as the CLI reports a Ctrl+C
        assert "restarting it" not in said
        assert said.count("registered as") <= 1, said  # the worker was not started again
        # What waiting out uvicorn's graceful timeout leaves, not a time, tells of it.
        assert "Exception in ASGI application" not in said
        assert follower_code == 0, "".join(followed)  # its stream ended; nothing failed


def test_a_sigterm_stops_the_server_in_order_as_a_ctrl_c_does(tmp_path: Path) -> None:
    """A service manager's stop (SIGTERM to the server alone): the orderly stop runs, so
    a replica alive then is in `ember usage` after a restart; uvicorn raised the signal
    again as it returned, which killed the process before any of that was written."""
    (tmp_path / "app.py").write_text(APP)
    root = tmp_path / "platform"
    with running_platform(root) as platform:
        platform.deploy(tmp_path / "app.py", "managed")
        with platform.client() as client:
            assert client.post("/managed--hello/", json={}).json() == {"hello": "world"}
        assert platform.process is not None
        platform.process.send_signal(signal.SIGTERM)
        code = platform.process.wait(30)
    assert code == 143, "\n".join(platform.output)  # 128 + SIGTERM, once stopped in order
    with running_platform(root) as platform:
        usage = json.loads(platform.ember("usage", "managed", "--json").stdout)
    rows = {row["endpoint"]: row for row in usage["endpoints"]}
    assert rows["hello"]["replicas"] == 1 and rows["hello"]["inputs"] >= 1, usage


def test_what_waits_when_the_server_stops_is_answered_at_once(tmp_path: Path) -> None:
    """A call's long poll, a queue's get and an `ember replica exec` command each end with
    an answer when the server stops, rather than hold it until uvicorn cuts them off."""
    (tmp_path / "app.py").write_text(APP)
    with running_platform(tmp_path / "platform") as platform:
        platform.deploy(tmp_path / "app.py", "waited")
        with platform.client() as client:
            spawned = client.post("/waited--slow/", headers={"Prefer": "respond-async"})
            assert spawned.status_code == 202, spawned.text
            status_url = spawned.json()["status_url"]
            answers: dict[str, int] = {}

            def wait_on(name: str, method: str, url: str, **kwargs: object) -> threading.Thread:
                def wait() -> None:
                    answers[name] = client.request(method, url, **kwargs).status_code  # type: ignore[arg-type]

                thread = threading.Thread(target=wait, daemon=True)
                thread.start()
                return thread

            waiters = [
                wait_on("call", "GET", status_url, params={"wait": "60"}),
                wait_on("queue", "POST", "/v1/apps/waited/queues/jobs/get", json={"timeout": 60}),
            ]
            wait_for(lambda: platform.endpoint_status("waited--slow")["running"] == 1, 30)
            [replica] = json.loads(platform.ember("replica", "ls", "waited", "--json").stdout)
            command = [*EMBER, "replica", "exec", replica["id"], "--", "sleep", "60"]
            execs = subprocess.Popen(
                command, env=platform.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            # Its line in the log: the command runs, and the two requests above, sent
            # before it, wait in the server.
            wait_for(lambda: "exec x-" in platform.ember("logs", "waited").stdout, 30)
            assert not answers, answers
            assert platform.process is not None
            os.killpg(platform.process.pid, signal.SIGINT)
            for waiter in waiters:
                waiter.join(30)
            _, exec_said = execs.communicate(timeout=30)
            platform.process.wait(30)
        said = "\n".join(platform.output)
        # Cut off by the graceful timeout, each was a 500 (and the exec a broken stream).
        assert answers == {"call": 202, "queue": 200}, said  # the call runs again later
        assert "the control plane is stopping" in exec_said, exec_said
        assert "Exception in ASGI application" not in said


def test_an_unknown_api_path_answers_json_404(platform: Platform) -> None:
    with platform.client() as client:
        for path in ("/v1/nope", "/v1/calls/c-a/b"):
            answer = client.get(path)
            assert answer.status_code == 404, path
            assert answer.headers["content-type"] == "application/json"
            error = answer.json()["error"]
            assert error["type"] == "not_found"
            assert path in error["message"]


def test_a_method_the_api_path_does_not_take_answers_json_405_with_allow(
    platform: Platform,
) -> None:
    with platform.client() as client:
        answer = client.put("/v1/apps/some-app/deployments")
        assert answer.status_code == 405
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["type"] == "method_not_allowed"
        # Both of the path's routes: deploying (POST) and the history (GET).
        assert answer.headers["allow"] == "GET, HEAD, POST"
        assert "GET, HEAD, POST" in answer.json()["error"]["message"]


def test_a_second_server_on_the_same_state_dir_is_refused(platform: Platform) -> None:
    """It would requeue and run again the first one's calls, and fire its schedules twice."""
    second = subprocess.run(
        [*EMBER, "server", "--state-dir", str(platform.state_dir), "--port", "0", "--no-worker"],
        env=platform.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1, second.stderr
    assert "is in use by another ember server (pid " in second.stderr
    with platform.client() as client:  # the first one serves on
        assert client.get("/v1/health").status_code == 200
