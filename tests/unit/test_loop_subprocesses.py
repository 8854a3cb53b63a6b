"""ember.calling.eventloop's uvloop starts asyncio subprocesses without running Python in the
forked child (uvloop's own do run it), and they behave as asyncio's: pipes, exit codes,
signals, shells, a program that is not there."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop  # ember[worker] depends on it

from ember.calling import eventloop

PIPE = asyncio.subprocess.PIPE


def on_embers_loop(test: Callable[[], Awaitable[Any]]) -> Any:
    factory = eventloop.loop_factory()
    assert factory is not None
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        return runner.run(test())


def test_pipes_exit_codes_and_signals() -> None:
    async def run() -> None:
        child = await asyncio.create_subprocess_exec(
            "sh", "-c", "cat; echo oops >&2; exit 3", stdin=PIPE, stdout=PIPE, stderr=PIPE
        )
        # More than a pipe holds: the write waits for the reader, as it comes.
        out, err = await child.communicate(b"line one\n" * 20000)
        assert (out, err) == (b"line one\n" * 20000, b"oops\n")
        assert child.returncode == 3

        sleeper = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
        assert sleeper.returncode is None
        assert os.getpgid(sleeper.pid) == sleeper.pid
        sleeper.kill()
        assert await sleeper.wait() == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):  # after its end, as with asyncio's
            sleeper.terminate()

        reader = await asyncio.create_subprocess_exec(
            "sh", "-c", "read line; echo got $line", stdin=PIPE, stdout=PIPE
        )
        assert reader.stdin is not None and reader.stdout is not None
        reader.stdin.write(b"it\n")
        await reader.stdin.drain()
        assert await reader.stdout.readline() == b"got it\n"
        assert await reader.wait() == 0

    on_embers_loop(run)


def test_shells_environments_and_exits_seen_without_waiting(tmp_path: Path) -> None:
    async def run() -> None:
        child = await asyncio.create_subprocess_shell(
            'pwd; echo "$WHO" >&2',
            cwd=tmp_path,
            env={"WHO": "me", "PATH": os.environ["PATH"]},
            stdout=PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert await child.communicate() == (f"{tmp_path}\nme\n".encode(), None)

        quick = await asyncio.create_subprocess_exec("true")
        for _ in range(2000):  # the loop reaps it with nobody waiting
            if quick.returncode is not None:
                break
            await asyncio.sleep(0.005)
        assert quick.returncode == 0

        with pytest.raises(ValueError, match="must be a string"):
            await asyncio.get_running_loop().subprocess_shell(
                asyncio.SubprocessProtocol,
                ["echo", "hi"],  # type: ignore[arg-type]
            )

    on_embers_loop(run)


def test_a_missing_program_raises_and_descriptors_are_passed(tmp_path: Path) -> None:
    async def run() -> None:
        with pytest.raises(FileNotFoundError):
            await asyncio.create_subprocess_exec(str(tmp_path / "nothing-here"))
        read_end, write_end = os.pipe()
        try:
            child = await asyncio.create_subprocess_exec(
                "sh", "-c", f"echo handed > /proc/self/fd/{write_end}", pass_fds=(write_end,)
            )
            assert await child.wait() == 0
            assert os.read(read_end, 100) == b"handed\n"
        finally:
            os.close(read_end)
            os.close(write_end)

    on_embers_loop(run)


def test_a_cancelled_start_kills_the_child(tmp_path: Path) -> None:
    """Cancelled while its pipes connect, the start kills and reaps what it started."""
    token = f"ember-cancelled-{os.getpid()}"

    def running() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if token.encode() in cmdline.read_bytes():
                    return True
            except OSError:
                continue
        return False

    async def run() -> None:
        task = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                "sh", "-c", "while :; do sleep 0.05; done", token, stdout=PIPE
            )
        )
        await asyncio.sleep(0)  # the process has started; its pipes are being connected
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not running()

    on_embers_loop(run)


class ForkedChildRanPython:
    """An at-fork hook that, while armed, marks a file in any child that runs Python."""

    armed: Path | None = None

    @classmethod
    def after_in_child(cls) -> None:
        if cls.armed is not None:
            cls.armed.touch()


hook_registered = False


@pytest.fixture
def python_in_child(tmp_path: Path) -> Iterator[Path]:
    global hook_registered
    if not hook_registered:  # hooks cannot be unregistered: one, disarmed after use
        os.register_at_fork(after_in_child=ForkedChildRanPython.after_in_child)
        hook_registered = True
    marker = tmp_path / "python-ran-in-the-child"
    ForkedChildRanPython.armed = marker
    try:
        yield marker
    finally:
        ForkedChildRanPython.armed = None


def test_no_python_runs_in_the_forked_child(python_in_child: Path) -> None:
    """What a threaded process needs: uvloop's own subprocesses run Python's at-fork
    hooks (and so possibly a garbage collection) in the child, Ember's loop's do not."""

    async def run() -> None:
        child = await asyncio.create_subprocess_exec("true")
        assert await child.wait() == 0
        shell = await asyncio.create_subprocess_shell("true")
        assert await shell.wait() == 0

    on_embers_loop(run)
    assert not python_in_child.exists()

    async def plain_uvloop() -> None:
        theirs = await asyncio.create_subprocess_exec("true")
        assert await theirs.wait() == 0

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(plain_uvloop())
    assert python_in_child.exists(), "uvloop no longer runs Python in its children"
