"""Process helpers the benchmarks share: start `ember server` (or another server), find
what it started, and stop all of it; name the part of a benchmark that failed.

Run as a script, it checks itself: a server-like process whose child moved to a session
of its own (as a restored replica does) is started, found and stopped, and nothing of it
may be left running.

    .venv/bin/python bench/procs.py            # a second or two (--quick: the same)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_STARTED = time.monotonic()


def children_map() -> dict[int, list[int]]:
    """Parent PID -> child PIDs, for every process on the machine."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree = children_map()
    found: list[int] = []
    todo = list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(tree.get(child, []))
    return found


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def still_running(pid: int, command: str) -> bool:
    """The same process is alive: not a zombie, and its PID not reused by another."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and cmdline(pid) == command


SERVER_URL_LINE = r"Ember is serving at (https://\S+)"  # what `ember server` prints once up
PLATFORM_BOOT_TIMEOUT_S = 120.0


def isolated_env(work: Path, **extra: str) -> dict[str, str]:
    """This environment for an `ember server` and CLI of the benchmark's own: the config
    file and HOME in `work`, without the EMBER_* variables that would point elsewhere;
    `extra` handed on to its replicas too (`--replica-env`'s default, EMBER_REPLICA_ENV:
    a replica gets nothing else of the server's environment)."""
    env = {**os.environ, "EMBER_CONFIG": str(work / "config.json"), "HOME": str(work / "home")}
    for name in ("EMBER_TOKEN", "EMBER_SERVER_URL", "EMBER_CA_CERT"):
        env.pop(name, None)
    (work / "home").mkdir(exist_ok=True)
    return {**env, **extra, "EMBER_REPLICA_ENV": ":".join(extra)}


def progress(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[{time.monotonic() - _STARTED:5.1f} s] {message}", file=sys.stderr, flush=True)


def log_tail(log: Path, lines: int = 30) -> str:
    """The last lines of a process's log file, for error messages."""
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def wait_for_line(
    process: subprocess.Popen[bytes], log: Path, name: str, pattern: str, timeout: float
) -> re.Match[str]:
    """Poll `log` until `pattern` appears in it; fail if `process` exits or time runs out."""
    deadline = time.monotonic() + timeout
    compiled = re.compile(pattern, re.MULTILINE)
    while time.monotonic() < deadline:
        match = compiled.search(log.read_text(errors="replace"))
        if match:
            return match
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}:\n{log_tail(log)}")
        time.sleep(0.05)
    raise RuntimeError(f"{name} printed no {pattern!r} in {timeout:g} s:\n{log_tail(log)}")


def server_url(server: ServerProcess, timeout: float) -> str:
    """The URL an `ember server` the benchmark started serves at, once it does."""
    return wait_for_line(server.process, server.log, server.name, SERVER_URL_LINE, timeout)[1]


class ServerProcess:
    """A server the benchmark started in a session of its own, its output in `log`.

    Restored replicas and CRIU run in sessions of their own, so the process group alone
    does not reach them: `remember` notes every process below the server (call it while
    they run), and `stop` ends the group, then whatever it noted that is left, by PID.
    """

    def __init__(self, name: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log
        self.seen: dict[int, str] = {}  # PID -> command line

    @classmethod
    def start(
        cls,
        name: str,
        command: Sequence[str],
        log: Path,
        env: dict[str, str],
        preexec_fn: Callable[[], None] | None = None,
    ) -> ServerProcess:
        with log.open("wb") as handle:
            process = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl+C reaches the benchmark only; it stops this
                preexec_fn=preexec_fn,
            )
        return cls(name, process, log)

    def remember(self) -> None:
        for pid in descendants(self.process.pid):
            self.seen.setdefault(pid, cmdline(pid))

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log, lines)

    def stop(self, term_timeout: float = 30.0, grace: float = 10.0) -> None:
        """SIGTERM the group (SIGKILL after `term_timeout`), then give what it started
        `grace` seconds to exit (replicas do when their lifeline closes) and SIGKILL it."""
        if self.process.poll() is None:
            self.remember()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=term_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        deadline = time.monotonic() + grace
        for pid, command in sorted(self.seen.items()):
            while time.monotonic() < deadline and still_running(pid, command):
                time.sleep(0.05)
            if still_running(pid, command):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def stopped_at_exit(**stop_options: float) -> Iterator[list[ServerProcess]]:
    """A list to put started servers in; all are stopped when the block ends, by an error,
    Ctrl+C or SIGTERM too (SIGTERM unwinds like Ctrl+C while the block runs)."""
    started: list[ServerProcess] = []
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield started
    finally:
        # A second Ctrl+C must not leave processes behind; every wait in stop() is bounded.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for server in reversed(started):
                server.stop(**stop_options)
        finally:
            signal.signal(signal.SIGINT, interrupt)
            signal.signal(signal.SIGTERM, previous)


def fill_defaults(
    args: argparse.Namespace, defaults: dict[str, tuple[Any, Any]]
) -> argparse.Namespace:
    """Each option left unset gets its default: (the full run's, the quick mode's)."""
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


class Parts:
    """Which part of a benchmark runs now, so that a failure can say where it stopped."""

    def __init__(self, bench: str, first: str = "setting up") -> None:
        self.bench = bench
        self.now = first

    def line(self, error: BaseException) -> str:
        """One line: the part that failed and why (the error's first line)."""
        first = str(error).strip().partition("\n")[0]
        return f"{self.now} failed: {type(error).__name__}: {first}"

    def say(self, error: BaseException) -> None:
        """The line on stderr, after what the benchmark measured; then the rest of the
        error's text (a log's tail, say)."""
        print(f"{self.bench}: {self.line(error)}", file=sys.stderr)
        if rest := str(error).strip().partition("\n")[2]:
            print(rest, file=sys.stderr)

    def show(
        self,
        figures: dict[str, Any],
        failed: BaseException | None,
        as_json: bool,
        report: Callable[[dict[str, Any]], str],
    ) -> bool:
        """What the benchmark measured, as JSON or its report, with the failed part's line
        in it and then on stderr; whether a part failed."""
        if failed is not None:
            figures["failed"] = self.line(failed)
        print(json.dumps(figures, indent=2) if as_json else report(figures), flush=True)
        if failed is not None:
            self.say(failed)
        return failed is not None


def platform_with_app(
    work: Path, app_file: Path, app: str, env: dict[str, str], started: list[ServerProcess]
) -> tuple[ServerProcess, Any]:
    """`ember server` (state in `work/state`, its log `work/server.log`) with `app_file`
    deployed as `app` and ready (`--wait`); the server, and a ClientConfig for its admin."""
    from ember.config import ClientConfig

    state = work / "state"
    ember_cli = [sys.executable, "-m", "ember.cli.main"]
    command = [*ember_cli, "server", "--state-dir", str(state), "--port", "0"]
    server = ServerProcess.start("ember server", command, work / "server.log", env)
    started.append(server)
    url = server_url(server, PLATFORM_BOOT_TIMEOUT_S)
    deploy = [*ember_cli, "deploy", str(app_file), "--name", app, "--wait"]
    subprocess.run(deploy, env=env, check=True, timeout=300, capture_output=True)
    config = ClientConfig(
        server_url=url,
        token=(state / "admin-token").read_text().strip(),
        ca_cert=str(state / "ca.pem"),
    )
    return server, config


# The self-check's server: a child that leaves for a session of its own (the group's
# SIGTERM misses it, as it misses a restored replica), then the line a server prints.
_TREE = """
import subprocess, sys, time
stray = subprocess.Popen(
    [sys.executable, "-c", "import os, time; os.setsid(); print(1, flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE,
)
stray.stdout.readline()  # it runs its own command line now, in its own session
print("serving", flush=True)
time.sleep(600)
"""


def self_check(quiet: bool) -> int:
    """Start _TREE, find what it started and stop it; 0 when nothing of it is left."""
    import tempfile

    parts = Parts("bench/procs.py", "start")
    with tempfile.TemporaryDirectory(prefix="ember-procs-check-") as folder:
        try:
            with stopped_at_exit(grace=0.5) as started:
                command = [sys.executable, "-c", _TREE]
                server = ServerProcess.start("tree", command, Path(folder) / "log", {**os.environ})
                started.append(server)
                wait_for_line(server.process, server.log, server.name, r"^serving$", 30)
                server.remember()
                found = len(server.seen)
                progress(quiet, f"started: the server and {found} process(es) below it")
                parts.now = "stop"
                began = time.monotonic()
                server.stop(term_timeout=10.0, grace=0.5)  # then SIGKILL: it waits for nothing
                took = time.monotonic() - began
                deadline = time.monotonic() + 5.0  # SIGKILL takes effect soon, not at once
                while left := [p for p, line in server.seen.items() if still_running(p, line)]:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        except Exception as error:
            parts.say(error)
            return 2
    ok = found == 1 and not left
    print(f"found below the server: {found} process(es) (1 expected, in a session of its own)")
    print(f"stop: {took:.2f} s, {len(left)} left running: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="bench/procs.py",
        description="Check the helpers: start a server whose child left its session, find "
        "both, stop both.",
    )
    parser.add_argument("--quick", action="store_true", help="the same check (it is quick)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    return self_check(args.quiet)


if __name__ == "__main__":
    sys.exit(main())
