"""The worker's side of `ember replica exec`: a real command run with the replica's
folder and environment, its output in chunks, its end, a timeout and a cancel. What it
sends is read as the control plane gets it (`sent`: each message as JSON would have it)."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.replica_exec import ExecContext, ExecRun, exit_code

Sent = wire.ExecOutput | wire.ExecExit


def _run(
    context: ExecContext,
    command: list[str],
    timeout: float | None = None,
    stdin: bytes | None = None,
) -> list[dict]:
    sent: list[dict[str, Any]] = []

    async def send(message: Sent) -> None:
        sent.append(wire.to_builtins(message))

    asyncio.run(ExecRun("x-1", context, command, timeout, send, stdin=stdin).run())
    return sent


def _output(sent: list[dict], stream: str) -> bytes:
    return b"".join(
        base64.b64decode(m["data"])
        for m in sent
        if m["type"] == "exec_output" and m["stream"] == stream
    )


def test_a_command_runs_in_the_folder_with_the_environment_and_ends_with_its_status(
    tmp_path: Path,
) -> None:
    context = ExecContext(tmp_path, {"PATH": os.defpath, "GREETING": "hello"})
    sent = _run(context, ["sh", "-c", 'pwd; echo "$GREETING"; echo oops >&2; exit 5'])
    assert _output(sent, "stdout").decode() == f"{tmp_path}\nhello\n"
    assert _output(sent, "stderr") == b"oops\n"
    assert sent[-1] == {"type": "exec_exit", "exec_id": "x-1", "exit_code": 5}
    piped = _run(context, ["sh", "-c", "wc -c; cat"], stdin=b"")  # empty input: EOF at once
    assert _output(piped, "stdout").split() == [b"0"]
    fed = _run(
        context, ["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin=b"abc"
    )
    assert _output(fed, "stdout") == b"cba\n"
    deaf = _run(context, ["true"], stdin=bytes(4 << 20))  # stops reading: no harm done
    assert deaf[-1]["exit_code"] == 0
    big = _run(context, ["head", "-c", "300000", "/dev/zero"])
    assert _output(big, "stdout") == bytes(300000)  # in several chunks
    assert sum(m["type"] == "exec_output" for m in big) > 1


def test_a_missing_command_a_signal_and_a_timeout_are_reported(tmp_path: Path) -> None:
    context = ExecContext(tmp_path, {"PATH": os.defpath})
    missing = _run(context, ["no-such-command-here"])
    assert missing[-1]["exit_code"] == 127 and "no-such-command-here" in missing[-1]["error"]
    killed = _run(context, ["sh", "-c", "kill -9 $$"])
    assert killed[-1]["exit_code"] == 137
    assert exit_code(-15) == 143 and exit_code(2) == 2
    timed = _run(context, ["sh", "-c", "echo started; sleep 30"], timeout=0.5)
    assert _output(timed, "stdout") == b"started\n"  # what it wrote before it was killed
    assert timed[-1]["exit_code"] == 124 and "timeout of 0.5 s" in timed[-1]["error"]


def test_a_cancelled_command_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    context = ExecContext(tmp_path, {"PATH": os.defpath})

    async def scenario() -> list[dict]:
        sent: list[dict[str, Any]] = []

        async def send(message: Sent) -> None:
            sent.append(wire.to_builtins(message))

        command = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
        task = asyncio.ensure_future(ExecRun("x-2", context, command, None, send).run())
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sent

    sent = asyncio.run(scenario())
    assert not any(m["type"] == "exec_exit" for m in sent)  # cancelled: nothing more said
    child = int(pid_file.read_text())
    for _ in range(200):  # the kill is sent at once; the kernel takes a moment
        if not Path(f"/proc/{child}").exists() or "Z" in _state(child):
            break
        asyncio.run(asyncio.sleep(0.01))
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _interactive(
    context: ExecContext,
    command: list[str],
    steps: list[tuple[str, Any]],
    terminal_size: tuple[int, int] | None = None,
) -> list[dict]:
    """Run `command` interactively, doing `steps` (feed bytes, resize, end input, wait
    for some output) while it runs."""
    sent: list[dict[str, Any]] = []

    async def send(message: Sent) -> None:
        sent.append(wire.to_builtins(message))

    async def scenario() -> None:
        run = ExecRun(
            "x-3", context, command, 20.0, send, interactive=True, terminal_size=terminal_size
        )
        task = asyncio.ensure_future(run.run())
        for step, value in steps:
            if step == "feed":
                run.feed(value)
            elif step == "resize":
                run.resize(*value)
            elif step == "end":
                run.end_input()
            elif step == "wait_for":
                while value not in _output(sent, "stdout"):
                    await asyncio.sleep(0.01)
        await asyncio.wait_for(task, 20)

    asyncio.run(scenario())
    return sent


def test_input_sent_while_it_runs_reaches_the_command(tmp_path: Path) -> None:
    context = ExecContext(tmp_path, {"PATH": os.defpath})
    steps = [("feed", b"one\n"), ("wait_for", b"ONE"), ("feed", b"two\n"), ("end", None)]
    upper = 'while read -r line; do echo "$line" | tr a-z A-Z; done'  # a line at a time
    sent = _interactive(context, ["sh", "-c", upper], steps)
    assert _output(sent, "stdout") == b"ONE\nTWO\n" and sent[-1]["exit_code"] == 0


def test_a_terminal_has_the_callers_size_and_is_the_commands_own(tmp_path: Path) -> None:
    context = ExecContext(tmp_path, {"PATH": os.defpath})
    script = "stty size; tty; read line; stty size; echo got:$line; exit 4"
    steps = [("wait_for", b"/dev/pts/"), ("resize", (30, 100)), ("feed", b"abc\n")]
    sent = _interactive(context, ["sh", "-c", script], steps, terminal_size=(24, 80))
    output = _output(sent, "stdout").replace(b"\r\n", b"\n")
    assert output.startswith(b"24 80\n/dev/pts/")
    assert b"30 100\ngot:abc\n" in output  # the new size, and what was typed
    assert _output(sent, "stderr") == b""  # a terminal has one stream
    assert sent[-1]["exit_code"] == 4
    # Ctrl+C typed at it interrupts it, as at a console.
    stopped = _interactive(
        context,
        ["sh", "-c", "echo ready; sleep 30"],
        [("wait_for", b"ready"), ("feed", b"\x03")],
        terminal_size=(24, 80),
    )
    assert stopped[-1]["exit_code"] == 130
