"""ember_worker.child_processes: the agent's children, started without running Python in
the forked child (uvloop's subprocesses do run it), their pipes as asyncio streams."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ember_worker import child_processes

uvloop = pytest.importorskip("uvloop")


def on_uvloop(test: Callable[[], Awaitable[Any]]) -> Any:
    """Run `test` on uvloop, the agent's event loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(test())


def test_pipes_exit_codes_and_signals() -> None:
    async def run() -> None:
        child = await child_processes.start(
            "sh",
            "-c",
            "cat; echo oops >&2; exit 3",
            stdin=child_processes.PIPE,
            stdout=child_processes.PIPE,
            stderr=child_processes.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(b"line one\n" * 20000)  # more than a pipe holds: drain waits
        await child.stdin.drain()
        child.stdin.close()
        out, err = await child.communicate()
        assert (out, err) == (b"line one\n" * 20000, b"oops\n")
        assert child.returncode == 3

        sleeper = await child_processes.start("sleep", "30", start_new_session=True)
        assert sleeper.returncode is None
        assert os.getpgid(sleeper.pid) == sleeper.pid
        sleeper.kill()
        assert await sleeper.wait() == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            sleeper.terminate()

    on_uvloop(run)


def test_stderr_into_stdout_and_the_exit_seen_without_waiting(tmp_path: Path) -> None:
    async def run() -> None:
        child = await child_processes.start(
            "sh",
            "-c",
            'pwd; echo "$WHO" >&2',
            cwd=tmp_path,
            env={"WHO": "me", "PATH": os.environ["PATH"]},
            stdout=child_processes.PIPE,
            stderr=child_processes.STDOUT,
        )
        assert await child.communicate() == (f"{tmp_path}\nme\n".encode(), b"")

        quick = await child_processes.start("true")
        for _ in range(2000):  # the event loop reaps it, nobody waiting
            if quick.returncode is not None:
                break
            await asyncio.sleep(0.005)
        assert quick.returncode == 0

    on_uvloop(run)


def test_a_missing_program_raises_and_descriptors_are_passed(tmp_path: Path) -> None:
    async def run() -> None:
        with pytest.raises(FileNotFoundError):
            await child_processes.start(str(tmp_path / "nothing-here"))
        read_end, write_end = os.pipe()
        try:
            child = await child_processes.start(
                "sh", "-c", f"echo handed > /proc/self/fd/{write_end}", pass_fds=(write_end,)
            )
            assert await child.wait() == 0
            assert os.read(read_end, 100) == b"handed\n"
        finally:
            os.close(read_end)
            os.close(write_end)

    on_uvloop(run)


class ForkedChildRanPython:
    """An at-fork hook that, while armed, marks a file in any child that runs Python."""

    armed: Path | None = None

    @classmethod
    def after_in_child(cls) -> None:
        if cls.armed is not None:
            cls.armed.touch()


os_hook_registered = False


@pytest.fixture
def python_in_child(tmp_path: Path) -> Iterator[Path]:
    global os_hook_registered
    if not os_hook_registered:  # hooks cannot be unregistered: one, disarmed after use
        os.register_at_fork(after_in_child=ForkedChildRanPython.after_in_child)
        os_hook_registered = True
    marker = tmp_path / "python-ran-in-the-child"
    ForkedChildRanPython.armed = marker
    try:
        yield marker
    finally:
        ForkedChildRanPython.armed = None


def test_no_python_runs_in_the_forked_child(python_in_child: Path) -> None:
    """What the agent's children need: uvloop's subprocesses run Python's at-fork hooks
    (and so possibly a garbage collection) in the child, these do not."""

    async def run() -> None:
        child = await child_processes.start("true")
        assert await child.wait() == 0
        assert not python_in_child.exists()

        theirs = await asyncio.create_subprocess_exec("true")
        assert await theirs.wait() == 0
        assert python_in_child.exists(), "uvloop no longer runs Python in its children"

    on_uvloop(run)
