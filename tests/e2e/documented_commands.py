"""The commands the documents give a reader, read from the documents and run as written
against a test's server, so that the tests follow the documents when they change.

An example documents its commands in its README.md (its fenced shell blocks: ```sh, or no
language, as examples/transformer's) or else in its app.py's docstring (the lines that
start with a command, after any leading spaces or `$ `). The commands run here are its
calls, `ember call ...` and `curl ...` (after any `NAME=value` assignments): its deploy is
the test's, made once. A command that cannot run here is listed in NOT_RUN with why; a
test runs the others with `run_documented`, each checked by how its line begins.

What differs from a reader's machine, and how a line is mapped (nothing else is changed):
- The harness's server listens on a free port (8443 may be taken by another test or by a
  server of the machine's): `https://127.0.0.1:8443` in a line is replaced by its URL.
- Each server has a HOME of its own (the harness's). `reader_platform` puts its state dir
  where `ember server` keeps it by default, `~/.ember/server` under that HOME, so that a
  line's `~/.ember/server/ca.pem` and `admin-token` are read as written.
- The lines run with bash, the test's own virtualenv's bin (`.venv/bin`, where `ember`
  is) first on PATH, in a folder of the test's (a line may write a file there)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import Platform

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
README_URL = "https://127.0.0.1:8443"
DEFAULT_STATE_DIR = "~/.ember/server"  # `ember server`'s, under HOME
# The environment the documents assume: the test's own virtualenv's bin (.venv/bin) first.
VENV_BIN = str(Path(sys.executable).parent)

# Documented commands not run by any test, by example and how the line begins: why.
NOT_RUN: dict[tuple[str, str], str] = {
    ("audio", "curl ... "): "elides curl's CA and token options (`curl ...`), so it does "
    "not run as written; test_examples.py::test_audio_example makes both requests with them",
}

# The test that runs an example's other documented commands with `run_documented`.
RUN_BY: dict[str, str] = {
    "hello": "test_examples.py::test_server_deploys_example_and_prints_a_working_curl_line",
    "classifier": "test_examples.py::test_classifier_example",
    "webapp": "test_examples.py::test_webapp_example",
    "embeddings": "test_example_embeddings.py::test_the_documented_call_answers",
    "transformer": "test_example_transformer.py::"
    "test_transformer_example_answers_alike_cold_and_restored",
    "llm": "test_readme_tour.py::test_llm_block_runs_as_written",
}

# A command of the ones run here: a call, after any variable assignments.
CALL = re.compile(r"(?:[A-Za-z_]\w*=\S*\s+)*(?:ember\s+call|curl)\s")
FENCED = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL_LANGUAGES = ("", "sh", "bash", "shell", "console")


@dataclass(frozen=True)
class Command:
    example: str
    line: str
    not_run: str | None  # why, where NOT_RUN lists it


def document(example: str) -> tuple[Path, str]:
    """The example's document of its commands, and the text holding them: its README.md's
    shell blocks, or else its app.py's docstring."""
    readme = EXAMPLES / example / "README.md"
    if readme.exists():
        blocks = FENCED.findall(readme.read_text())
        return readme, "\n".join(text for language, text in blocks if language in SHELL_LANGUAGES)
    app = EXAMPLES / example / "app.py"
    return app, ast.get_docstring(ast.parse(app.read_text())) or ""


def shell_lines(text: str) -> list[str]:
    """The lines of `text`, a backslash's continuation joined to its line, without leading
    spaces or a prompt's `$ `."""
    lines = (line.strip() for line in text.replace("\\\n", " ").splitlines())
    return [line.removeprefix("$ ") for line in lines if line]


def documented_commands(example: str) -> list[Command]:
    """The example's documented calls (`ember call`, `curl`), in the document's order."""
    _, text = document(example)
    return [
        Command(example, line, not_run_reason(example, line))
        for line in shell_lines(text)
        if CALL.match(line)
    ]


def not_run_reason(example: str, line: str) -> str | None:
    for (name, start), why in NOT_RUN.items():
        if name == example and line.startswith(start):
            return why
    return None


def examples() -> list[str]:
    return sorted(path.name for path in EXAMPLES.iterdir() if (path / "app.py").exists())


def reader_platform(root: Path, **kwargs: Any) -> Platform:
    """The harness's Platform (not started) with its state dir where `ember server` keeps
    it by default: `~/.ember/server` under the harness's HOME for it."""
    platform = Platform(root, **kwargs)
    platform.state_dir = platform.root / "home" / ".ember" / "server"
    return platform


@contextmanager
def running_reader_platform(root: Path, **kwargs: Any) -> Iterator[Platform]:
    platform = reader_platform(root, **kwargs).start()
    try:
        yield platform
    finally:
        platform.stop()


def mapped(line: str, platform: Platform) -> str:
    """`line` as it runs against `platform`: the documents' URL replaced by the server's."""
    command = line.replace(README_URL, platform.url)
    assert "8443" not in command, command  # every port the documents name is mapped
    if DEFAULT_STATE_DIR in command:
        home = Path(platform.env["HOME"])
        assert platform.state_dir == home / ".ember" / "server", (
            f"{line!r} reads {DEFAULT_STATE_DIR}: start the server with reader_platform"
        )
    return command


def home_path(word: str, home: Path) -> str:
    """`word` with a leading `~` read as bash reads it, for the harness's HOME."""
    return str(home) + word[1:] if word == "~" or word.startswith("~/") else word


def with_venv(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"}


def bash(
    line: str, cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# What a documented command must print, given its standard output.
Check = Callable[[str], None]


def run_documented(
    example: str,
    platform: Platform,
    checks: dict[str, Check],
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> list[str]:
    """Runs the example's documented commands (those NOT_RUN aside) with bash against
    `platform`, each to exit status 0 and its check, the one of `checks` whose key begins
    its line. A command the document gains fails here until it has a check, and a check
    whose command the document lost fails too. Returns the lines run."""
    commands = documented_commands(example)
    assert commands, f"{document(example)[0]} documents no `ember call` or `curl` line"
    env = with_venv(platform.env) if env is None else env
    ran: list[str] = []
    used: set[str] = set()
    for command in commands:
        if command.not_run:
            print(f"not run: {command.line}\n  because it {command.not_run}")
            continue
        found = [start for start in checks if command.line.startswith(start)]
        assert len(found) == 1, f"{example}'s command {command.line!r} has no check: add one"
        done = bash(mapped(command.line, platform), cwd, env, timeout)
        assert done.returncode == 0, f"{command.line}\n{done.stdout}\n{done.stderr}"
        checks[found[0]](done.stdout)
        used.add(found[0])
        ran.append(command.line)
    unused = sorted(set(checks) - used)
    assert not unused, f"{document(example)[0].name} of {example} no longer runs {unused}"
    return ran
