"""Starts the platform the way a user does (`ember server`, `ember deploy`) for e2e tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ember.calling.tlsclient import client_context

EMBER = [sys.executable, "-m", "ember.cli.main"]
# The URL alone, even should the worker's output follow it on the same line.
SERVING = re.compile(r"Ember is serving at (https://(?:\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d+)")
STARTUP_TIMEOUT = 60.0
REPLICA_ENV_ENV = "EMBER_REPLICA_ENV"  # process_env.py's: `ember worker --replica-env`'s default
# How coverage (infra/test.sh) follows processes: replicas too, when handed on.
COVERAGE_ENV = ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Platform:
    """One `ember server` process with its own state dir, HOME and client config."""

    def __init__(
        self,
        root: Path,
        *,
        port: int = 0,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        replica_env: tuple[str, ...] | None = None,
    ) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.port = port
        self.extra = extra
        self.env = {
            **os.environ,
            "HOME": str(root / "home"),
            "EMBER_CONFIG": str(root / "config.json"),
            "PYTHONUNBUFFERED": "1",
        }
        self.env.pop("EMBER_TOKEN", None)
        self.env.pop("EMBER_SERVER_URL", None)
        self.env.update(env or {})  # for the server, its worker and replicas, and the CLI
        # Replicas get nothing of the worker's environment but the variables the operator
        # names (--replica-env; EMBER_REPLICA_ENV its default): here `replica_env`, else
        # those of `env`, and coverage's settings, so that replicas record theirs.
        passed = [*(sorted(env or {}) if replica_env is None else replica_env), *COVERAGE_ENV]
        self.env[REPLICA_ENV_ENV] = ":".join(dict.fromkeys(passed))
        self.process: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.url = ""

    def start(self) -> Platform:
        (self.root / "home").mkdir(parents=True, exist_ok=True)
        command = [
            *EMBER,
            "server",
            "--state-dir",
            str(self.state_dir),
            "--port",
            str(self.port),
            *self.extra,
        ]
        self.process = subprocess.Popen(
            command,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        ready = threading.Event()

        def read() -> None:
            assert self.process is not None and self.process.stdout is not None
            try:
                for line in self.process.stdout:
                    self.output.append(line.rstrip("\n"))
                    # Anywhere in the line: the worker shares this output and may have
                    # written part of a line of its own just before.
                    served = SERVING.search(line)
                    if served:
                        self.url = served.group(1)
                    if line.startswith("Press Ctrl+C"):
                        ready.set()
            except ValueError:
                return  # stop() closed the pipe while the worker still had lines in it

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(STARTUP_TIMEOUT):
            self.stop()
            raise RuntimeError("ember server did not start:\n" + "\n".join(self.output))
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process.stdout is not None:
            # Also when it had ended by itself: an unclosed pipe fails the run at exit.
            self.process.stdout.close()
        # The worker and replicas follow their parent through lifeline pipes. Polled
        # soon at first (the worker is often gone already), then at most every 0.1 s:
        # each poll reads all of /proc.
        deadline = time.monotonic() + 15
        pause = 0.01
        while time.monotonic() < deadline and self._descendants_alive():
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _descendants_alive(self) -> bool:
        assert self.process is not None
        return any(group == self.process.pid for group in _live_process_groups())

    @property
    def ca(self) -> str:
        return str(self.state_dir / "ca.pem")

    @property
    def token(self) -> str:
        return (self.state_dir / "admin-token").read_text().strip()

    def ember(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*EMBER, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"ember {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def tenant_env(self, token: str) -> dict[str, str]:
        """The CLI's environment for a caller holding `token` (a workspace's own: no
        EMBER_WORKSPACE, which an admin token would act in)."""
        env = {**self.env, "EMBER_TOKEN": token, "EMBER_SERVER_URL": self.url}
        env["EMBER_CA_CERT"] = self.ca
        env.pop("EMBER_WORKSPACE", None)
        return env

    def ember_as(
        self, token: str, *args: str, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """`ember ARGS` run by a caller holding `token`; its outcome whatever it is."""
        return subprocess.run(
            [*EMBER, *args],
            env=self.tenant_env(token),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def deploy(self, file: Path, name: str) -> dict[str, str]:
        """Deploy with the CLI; return {label: first URL} parsed from its output."""
        out = self.ember("deploy", str(file), "--name", name).stdout
        urls = {}
        for line in out.splitlines():
            parts = line.split()
            if (
                len(parts) >= 2
                and parts[0].startswith(f"{name}--")
                and parts[1].startswith("https://")
            ):
                urls[parts[0]] = parts[1]
        return urls

    def client(self, token: str | None = None, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        return httpx.Client(
            base_url=self.url, verify=client_context(self.ca), headers=headers, timeout=timeout
        )

    def status(self) -> dict[str, Any]:
        with self.client() as client:
            return client.get("/v1/apps").json()

    def endpoint_status(self, label: str) -> dict[str, Any]:
        for row in self.status()["endpoints"]:
            if row["label"] == label:
                return row
        raise KeyError(label)

    def config(self) -> Any:
        from ember.config import ClientConfig

        data = json.loads((self.root / "config.json").read_text())
        return ClientConfig(**data)

    def curl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["curl", "-sS", "--cacert", self.ca, *args], capture_output=True, text=True, timeout=60
        )


def _live_process_groups() -> Iterator[int]:
    """The process group of every process that has not exited. Zombies do not count: an
    orphan's exit is reaped by PID 1, which in a container may take a second or more."""
    # Listed, then read each: a glob of /proc/*/stat fails (ESRCH) on a process that
    # exits while it looks.
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            # After the command's name, in parentheses and maybe with spaces: state, ppid, pgrp.
            text = Path("/proc", pid, "stat").read_text()
            state, _ppid, group = text.rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state not in ("Z", "X"):
            yield int(group)


def replicas_reach(url: str) -> tuple[str, str]:
    """The worker flag that opens `url`'s port on this node's loopback (a test's S3 API)
    to sandboxed replicas, which have a loopback of their own."""
    port = urlsplit(url).port
    assert port is not None, url
    return ("--replica-loopback-port", str(port))


@contextmanager
def running_platform(root: Path, **kwargs: Any) -> Iterator[Platform]:
    platform = Platform(root, **kwargs).start()
    try:
        yield platform
    finally:
        platform.stop()


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


@contextmanager
def replicas_ready(platform: Platform, endpoint: Any, count: int) -> Iterator[None]:
    """`count` replicas of `endpoint` (an ember.Endpoint) started and ready, for calls made
    at once that must each find one of their own. The starts (cold boots, restores) are
    waited out here, however long they take on a loaded machine, rather than raced by
    the length of the calls. `min_replicas` is raised meanwhile (as `ember scale --min`
    does), and the deployed autoscaling holds again afterwards."""
    endpoint.update_autoscaler(min_replicas=count)
    wait_for(lambda: platform.endpoint_status(endpoint.label)["replicas"] == {"ready": count}, 120)
    yield
    endpoint.reset_autoscaler()


def join_worker(
    platform: Platform,
    token: str,
    work_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    mounted_at: Path | None = None,
    netns: str | None = None,
) -> subprocess.Popen[str]:
    """`ember worker` joining the platform as node `work_dir.name` (with `env` added to the
    platform's environment); its log goes to `<work_dir>.log` (a file: a pipe nobody reads
    could fill and stall it). With `mounted_at` (root only), it runs in a mount namespace
    of its own where `work_dir` is seen at `mounted_at`, its work dir there: the layout of
    separate machines whose workers use the same path (another worker's here). With
    `netns` (a network namespace's path; root only), it runs in that network: a node
    of another machine."""
    command = [
        sys.executable,
        "-m",
        "ember.cli.main",
        "worker",
        "--server",
        platform.url,
        "--token",
        token,
        "--ca-cert",
        platform.ca,
        "--work-dir",
        str(mounted_at or work_dir),
        "--name",
        work_dir.name,
        *extra,
    ]
    if mounted_at is not None:
        for folder in (work_dir, mounted_at):  # a mount needs both to exist
            folder.mkdir(parents=True, exist_ok=True)
        mount = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        command = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            mount,
            "mount-then-exec",  # $0
            str(work_dir),
            str(mounted_at),
            *command,
        ]
    if netns is not None:
        command = ["nsenter", f"--net={netns}", *command]
    with work_dir.with_suffix(".log").open("w") as log:  # the child keeps its own copy
        return subprocess.Popen(
            command,
            env={**platform.env, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
