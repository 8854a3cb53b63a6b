"""README.md's "A short tour", read from the README itself and run as written: its shell
lines with bash (`.venv/bin` first on PATH, as the tour assumes), its app.py and its
Python calling snippets, against a fresh `ember server`; the LLM block against a server
of its own, started with that block's flags.

What differs from a reader's machine, and how the test maps it (nothing else is changed):
- As for every documented command (documented_commands.py): the README's port 8443 is
  mapped to the harness's server's, whose state dir is `ember server`'s default,
  `~/.ember/server` under the harness's HOME, so the lines' `~/.ember/server/ca.pem` and
  `admin-token` are read as written.
- The LLM block's server line is started through the harness (which adds `--state-dir`,
  at its default as above, and `--port 0`), with the line's variable assignment and flags;
  the CLI commands after it get no such variable, as in a reader's other shell.
- After the LLM block's deploy, examples/llm/app.py's documented call (its docstring's
  `ember call llm--llm/generate ... --stream`) runs, as the example documents it; its
  replica's cold boot is the one the bench's requests then find ready.
- `ember bench` sends fewer requests than the line's 200 (BENCH_REQUESTS says why), with
  the line's other options; `ember profile` starts once the bench's replica is up.
- A line that follows (`ember logs ... -f`) runs beside the lines after it and is stopped
  as Ctrl+C stops it, once they have run.
- The Python snippets build on each other (the spawn snippet uses the call snippet's
  `echo`): they run in one Python process after `import ember`, in the README's order,
  each statement as Python's prompt runs it, so that an expression's value is printed
  (`echo.call(text="hi")  # {"text": "hi"}`).

Blocks not run here, and why: NOT_RUN."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from documented_commands import (
    REPO,
    bash,
    home_path,
    mapped,
    reader_platform,
    run_documented,
    with_venv,
)
from harness import Platform, wait_for
from machine_needs import snapshots_on

README = REPO / "README.md"
TOUR_HEADING = "## A short tour"
# The line's 200 requests of 128 tokens at 4/s are a load for a real node: one CPU replica
# here makes about 8 tokens/s (an hour for them), and more than its 8 streams at once
# would queue for a second replica, cold as well (the first one's snapshot is not taken
# yet). 4 arrive in the line's first second, at its rate, with its other options.
BENCH_REQUESTS = "4"

# Python blocks no tour command runs, by a line each holds: why.
NOT_RUN = {
    "class Classifier:": "the Snapshots section's sketch of a hook for the reader's own app: "
    "no command of the tour deploys it (examples/classifier/app.py, its deployed form, is "
    "run by test_examples.py)",
    "class Model:": "names a placeholder bucket (s3://bucket) and the reader's own MyNet: not "
    "runnable as written (test_weights.py runs weights= against an S3 API)",
}


@dataclass(frozen=True)
class Block:
    language: str
    text: str


def tour_blocks() -> list[Block]:
    """The fenced blocks of the README's tour, in order."""
    text = README.read_text()
    start = text.index(TOUR_HEADING)
    end = text.find("\n## ", start + len(TOUR_HEADING))
    section = text[start : end if end >= 0 else len(text)]
    fenced = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    return [Block(match[1], match[2]) for match in fenced.finditer(section)]


def shell_lines(block: Block) -> list[str]:
    """A shell block's commands, a backslash's continuation joined to its line."""
    lines = block.text.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip()]


def is_app_file(block: Block) -> bool:
    return block.language == "python" and block.text.startswith("# app.py\n")


def not_run_reason(block: Block) -> str | None:
    return next((why for mark, why in NOT_RUN.items() if mark in block.text), None)


def is_llm_block(block: Block) -> bool:
    return block.language == "sh" and " ember server " in f" {block.text}"


def _as_a_terminal_starts_it() -> None:
    """A terminal's shell starts a job with SIGINT at its default and no signal blocked;
    a child inherits both across exec, and the test process's may differ (in full runs
    on two processes, `ember logs -f` here ignored its Ctrl+C now and then)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_state(pid: int) -> str:
    """What /proc says of a process's signals (blocked, ignored, caught), for a failure."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return f"{pid}: gone"
    return f"{pid}: " + " ".join(
        line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
    )


class Background:
    """A line run by bash beside others (`-f`, a bench), its output gathered."""

    def __init__(self, line: str, cwd: Path, env: dict[str, str]) -> None:
        self.line = line
        self.process = subprocess.Popen(
            ["bash", "-c", line],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own group, as a terminal's foreground job
            preexec_fn=_as_a_terminal_starts_it,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def interrupt(self) -> None:
        """Ctrl+C: SIGINT to the foreground group."""
        os.killpg(self.process.pid, signal.SIGINT)

    def finish(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
            pids = [self.process.pid, *map(int, children.read_text().split())]
            state = "; ".join(_signal_state(pid) for pid in pids)
            mine = f"this process: blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}"
            raise AssertionError(
                f"{self.line} ran past {timeout} s ({state}; {mine}):\n{self.output}"
            ) from None
        finally:
            self.close()

    def close(self) -> None:
        """Ended (killed if need be), its output read and its pipe closed: also when the
        test failed before it finished."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()


# What each tour command (on the tour's server) must print, by how its line begins: an
# assertion on its output. A command the README gains fails the test until it has one.
Check = Callable[[str, Platform], None]


def _deployed(out: str, platform: Platform) -> None:
    assert f"{platform.url}/app--echo/" in out and f"{platform.url}/app--count/" in out, out


def _listed(out: str, platform: Platform) -> None:
    assert "app--echo" in out and "app--count" in out and "1 worker(s)" in out, out


def _echoed_twice(out: str, platform: Platform) -> None:
    assert json.loads(out) == {"text": "hihi"}, out


def _echoed_by_curl(out: str, platform: Platform) -> None:
    assert json.loads(out) == {"text": "hi"}, out


def _streamed(out: str, platform: Platform) -> None:
    assert [json.loads(line) for line in out.splitlines()] == [{"n": n} for n in range(3)], out


def _scaled(out: str, platform: Platform) -> None:
    assert re.search(r"^\s*min_replicas\s+1\b", out, re.MULTILINE), out


def snapshot_problem(platform: Platform) -> str | None:
    """Why the worker takes no snapshots, or None."""
    return platform.status()["workers"][0]["snapshots"].get("problem")


def _snapshots_listed(out: str, platform: Platform) -> None:
    assert out.startswith("ENDPOINT") and "SNAPSHOT" in out, out
    # Without snapshots ($EMBER_TEST_ALLOW_SKIP names criu) there is no image to list.
    if snapshots_on(snapshot_problem(platform)):
        rows = [line.split() for line in out.splitlines()[1:]]
        assert any(row[0] == "app--echo" and row[2] == "ready" for row in rows), out


def _followed(out: str, platform: Platform) -> None:
    # The platform's lines and the replicas' request lines, while the others ran.
    assert "echo [ember] deployed version 1" in out, out
    assert "[request] __call__ 200" in out, out


CHECKS: dict[str, Check] = {
    "ember deploy app.py": _deployed,
    "ember ls": _listed,
    "ember logs app -f": _followed,
    "ember call app--echo": _echoed_twice,
    "curl ": _echoed_by_curl,
    "ember call app--count": _streamed,
    "ember scale app--echo": _scaled,
    "ember snapshot ls": _snapshots_listed,
}


def check_of(line: str) -> Check:
    found = [check for start, check in CHECKS.items() if line.startswith(start)]
    assert len(found) == 1, f"the tour's command {line!r} has no check in CHECKS: add one"
    return found[0]


# Runs the snippets' statements as Python's prompt does (mode "single"): an expression's
# value is printed by sys.displayhook.
SNIPPET_RUNNER = """
import ast
import sys

import ember

namespace = {"ember": ember}
for path in sys.argv[1:]:
    with open(path) as file:
        for statement in ast.parse(file.read()).body:
            code = compile(ast.Interactive(body=[statement]), path, "single")
            exec(code, namespace)
"""


def test_every_block_of_the_tour_is_run_or_says_why_not() -> None:
    blocks = tour_blocks()
    assert sum(map(is_app_file, blocks)) == 1, "the tour's app.py"
    assert sum(map(is_llm_block, blocks)) == 1, "the tour's LLM block"
    for block in blocks:
        assert block.language in ("sh", "python"), block
    for mark in NOT_RUN:
        assert any(mark in block.text for block in blocks), f"no tour block holds {mark!r}"
    for block in blocks:
        if block.language == "sh" and not is_llm_block(block):
            for line in shell_lines(block):
                check_of(line)


@pytest.fixture
def tour_platform(tmp_path: Path) -> Iterator[Platform]:
    # `ember server`'s default state dir under the harness's HOME: ~/.ember/server.
    platform = reader_platform(tmp_path / "platform").start()
    try:
        yield platform
    finally:
        platform.stop()


def test_tour_runs_as_written(tour_platform: Platform, tmp_path: Path) -> None:
    platform = tour_platform
    blocks = tour_blocks()
    folder = tmp_path / "tour"  # the reader's folder: app.py, and where commands run
    folder.mkdir()
    app = next(block for block in blocks if is_app_file(block))
    (folder / "app.py").write_text(app.text)
    env = with_venv(platform.env)
    following: list[Background] = []
    snippets: list[Path] = []
    with ExitStack() as cleanup:
        for block in blocks:
            if is_llm_block(block) or is_app_file(block) or not_run_reason(block):
                continue
            if block.language == "python":
                snippets.append(folder / f"snippet{len(snippets)}.py")
                snippets[-1].write_text(block.text)
                continue
            for line in shell_lines(block):
                run_tour_line(line, platform, folder, env, following, cleanup)
        run_snippets(snippets, folder, env)
        assert following, "the tour's `ember logs app -f`"
        for follow in following:
            # Replicas' lines reach it in batches: wait for a call's before the Ctrl+C.
            wait_for(lambda follow=follow: "[request] __call__ 200" in follow.output, 30)
            follow.interrupt()
            assert follow.finish(30) == 130, follow.output  # as Ctrl+C ends it
            check_of(follow.line)(follow.output, platform)


def run_tour_line(
    line: str,
    platform: Platform,
    folder: Path,
    env: dict[str, str],
    following: list[Background],
    cleanup: ExitStack,
) -> None:
    command = mapped(line, platform)  # every port the README names mapped
    if "-f" in shlex.split(line, comments=True):
        following.append(Background(command, folder, env))
        cleanup.callback(following[-1].close)
        return
    if line.startswith("ember snapshot ls") and snapshots_on(snapshot_problem(platform)):
        # The first replica's image is stored after its first call's answer.
        wait_for(lambda: platform.endpoint_status("app--echo")["snapshots"], 60)
    done = bash(command, folder, env)
    assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    check_of(line)(done.stdout, platform)


def run_snippets(snippets: list[Path], folder: Path, env: dict[str, str]) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", SNIPPET_RUNNER, *map(str, snippets)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    printed = [ast.literal_eval(line) for line in ran.stdout.splitlines()]
    assert printed == [
        {"text": "hi"},  # echo.call(text="hi")
        {"text": "a"},  # echo.map(...)
        {"text": "b"},
        *({"n": n} for n in range(3)),  # .stream(to=3)
        {"text": "later"},  # handle.get(timeout=60)
    ], ran.stdout


def _tokens_streamed(out: str) -> None:
    """`generate`'s events, a token each: up to the call's 8 (`max_new_tokens`)."""
    events = [json.loads(line) for line in out.splitlines()]
    assert 1 <= len(events) <= 8, out
    assert all(list(event) == ["token_id"] for event in events), out
    assert all(isinstance(event["token_id"], int) for event in events), out


def ready_replicas(platform: Platform, label: str) -> int:
    return platform.endpoint_status(label)["replicas"].get("ready", 0)


def test_llm_block_runs_as_written(smollm2_dir: Path, tmp_path: Path) -> None:
    lines = shell_lines(next(block for block in tour_blocks() if is_llm_block(block)))
    at = next(i for i, line in enumerate(lines) if " ember server " in f" {line}")
    before, server_line, after = lines[:at], lines[at], lines[at + 1 :]

    # The server line: its variable assignments, then `ember server` and its flags.
    root = tmp_path / "platform"
    home = root / "home"
    words = shlex.split(server_line, comments=True)
    assigned: dict[str, str] = {}
    while re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        assigned[name] = home_path(value, home)
    assert words[:2] == ["ember", "server"], server_line
    flags = tuple(home_path(word, home) for word in words[2:])
    # Replicas get what the line hands on (--replica-env), not the harness's default.
    platform = reader_platform(root, extra=flags, env=assigned, replica_env=())
    cli_env = with_venv({k: v for k, v in platform.env.items() if k not in assigned})
    folder = tmp_path / "reader"  # where the commands run: the repository's examples/ in it
    folder.mkdir()
    (folder / "examples").symlink_to(REPO / "examples")

    for line in before:
        words = shlex.split(line, comments=True)
        assert words[:2] == ["python", "examples/llm/convert.py"], line
        # The session's conversion (tests/conftest.py's, by the same convert()) is linked
        # where the line writes, so that the model is converted once a session: the line
        # finds it done.
        out = Path(home_path(words[words.index("--out") + 1], home))
        out.mkdir(parents=True)
        for file in smollm2_dir.iterdir():
            os.link(file, out / file.name)
        done = bash(line, folder, cli_env)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        assert "already holds this conversion; nothing to do" in done.stdout, done.stdout

    with ExitStack() as cleanup:
        platform.start()
        cleanup.callback(platform.stop)
        bench: Background | None = None
        for line in after:
            command = mapped(line, platform)
            if line.startswith("ember deploy examples/llm/app.py"):
                done = bash(command, folder, cli_env)
                assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
                assert f"llm--llm  {platform.url}/llm--llm/" in done.stdout, done.stdout
                # The example's own documented call: it waits out the replica's cold boot.
                checks = {"ember call llm--llm/generate ": _tokens_streamed}
                run_documented("llm", platform, checks, folder, cli_env)
            elif line.startswith("ember bench llm/llm/v1/chat/completions "):
                assert " --num-requests 200 " in command, command
                command = command.replace(" 200 ", f" {BENCH_REQUESTS} ")
                bench = Background(command, folder, cli_env)
                cleanup.callback(bench.close)
            elif line.startswith("ember profile llm--llm "):
                assert bench is not None and "while the bench runs" in line, line
                # A replica to profile: the documented call's, booted cold.
                wait_for(lambda: ready_replicas(platform, "llm--llm"), 280)
                assert bench.process.poll() is None, bench.output  # still running
                done = bash(command, folder, cli_env)
                assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
                assert "wrote flame.svg" in done.stderr, done.stderr
                assert "<svg" in (folder / "flame.svg").read_text()[:2000]
            else:
                raise AssertionError(f"the LLM block's command {line!r} has no check here")
        assert bench is not None, "the LLM block's `ember bench`"
        assert bench.finish(280) == 0, bench.output
        report = bench.output
        assert re.search(rf"^requests +{BENCH_REQUESTS} ok, 0 failed$", report, re.M), report
        # TTFT, ITL and E2E at P50, P95 and P99, and the goodput of the line's objectives.
        assert re.search(r"^latency \(ms\) +mean +P50 +P95 +P99$", report, re.M), report
        for measure in ("TTFT (time to first token)", "ITL ", "E2E "):
            assert f"\n{measure}" in report, report
        assert "met ttft<=500.0ms, itl<=50.0ms)" in report, report
        # The replica found the conversion: --model-dir showed it the folder, and
        # --replica-env handed it EMBER_LLM_DIR.
        logs = platform.ember("logs", "llm", "-n", "500").stdout
        assert f"{assigned['EMBER_LLM_DIR']} already holds this conversion" in logs, logs
