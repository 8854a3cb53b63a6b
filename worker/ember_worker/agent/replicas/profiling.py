"""`ember profile`: py-spy run by the agent against a replica's process. The agent runs
it as itself (root, outside the replica's user, mount namespace, cgroups and seccomp
filter, which bind the replica and not its tracer; inside its PID namespace, see
`in_pid_namespace_of`), never a command of the caller's: the caller only chooses among
py-spy's modes and formats (`wire.ProfileSpec`). Works alike on cold and restored (CRIU)
replicas: py-spy reads the interpreter's memory, whichever way it got there.

`record` samples the replica's stacks for a while into a file (an SVG flame graph or a
speedscope JSON) and sends the file back as the command's output; `dump` prints every
thread's stack once. What py-spy itself says goes to the caller's stderr. Native frames
are asked for first; where py-spy cannot unwind them here, it runs again without them,
and says so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from ember.wire import messages as wire
from ember_worker.agent.replica_exec import (
    CHUNK_BYTES,
    EXIT_CANNOT_RUN,
    EXIT_TIMED_OUT,
    ExecContext,
    Send,
    exit_code,
)
from ember_worker.agent.replicas.provisioning import REPLICA_PID_ENV
from ember_worker.processes.process_env import ROOT_ENV

PY_SPY = "py-spy"
# Past its sampling time, how long py-spy may take to attach and write its file.
SLACK_SECONDS = 60.0


def py_spy_path() -> str | None:
    """py-spy beside this interpreter (the worker's virtual environment), else on PATH."""
    here = str(Path(sys.executable).parent)
    return shutil.which(PY_SPY, path=os.pathsep.join([here, os.environ.get("PATH", "")]))


def in_pid_namespace_of(host_pid: int) -> tuple[list[str], int]:
    """(command prefix, PID to name) that run py-spy inside the replica's PID namespace,
    with a /proc of that namespace in a mount namespace of its own, when the replica has
    one: py-spy matches a Python thread to its OS thread by the id the thread has in its
    namespace, and from outside finds none, so that native frames fail (libunwind's
    UNW_EBADREG) and idle threads count as busy. ([], host_pid) where the replica shares
    this process's namespace, or the tools or the rights are missing."""
    try:
        if os.readlink("/proc/self/ns/pid") == os.readlink(f"/proc/{host_pid}/ns/pid"):
            return [], host_pid
        status = Path(f"/proc/{host_pid}/status").read_text()
    except OSError:
        return [], host_pid
    nspid = next(
        (line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), []
    )
    nsenter, unshare = shutil.which("nsenter"), shutil.which("unshare")
    if os.geteuid() != 0 or not nspid or not nspid[-1].isdigit() or not nsenter or not unshare:
        return [], host_pid
    prefix = [nsenter, "--target", str(host_pid), "--pid", "--"]
    prefix += [unshare, "--mount", "--mount-proc", "--propagation", "private", "--"]
    return prefix, int(nspid[-1])


def py_spy_command(
    py_spy: str, pid: int, spec: wire.ProfileSpec, output: Path, *, native: bool
) -> list[str]:
    """The py-spy command line for `spec` against process `pid`."""
    if spec.mode == "dump":
        command = [py_spy, "dump", "--pid", str(pid)]
    else:
        command = [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, math.ceil(spec.duration))),
            "--rate",
            str(spec.rate),
            "--format",
            spec.format,
            "--output",
            str(output),
        ]
    # Its child processes too (an engine's workers): a replica is often more than one.
    command.append("--subprocesses")
    if native:
        command.append("--native")
    return command


class ProfileRun:
    """One `ember profile` of a replica; `run` sends its output, then its end."""

    def __init__(
        self, exec_id: str, context: ExecContext, spec: wire.ProfileSpec, send: Send
    ) -> None:
        self.exec_id = exec_id
        self.context = context
        self.spec = spec
        self.send = send

    async def run(self) -> None:
        py_spy = py_spy_path()
        pid = self.context.env.get(REPLICA_PID_ENV, "")
        if py_spy is None:
            await self._exit(
                EXIT_CANNOT_RUN,
                "py-spy is not installed on this worker: `pip install py-spy` in the "
                "worker's environment (bash infra/install.sh installs it)",
            )
            return
        if not pid.isdigit():
            await self._exit(EXIT_CANNOT_RUN, "the replica's process is not known here")
            return
        folder = Path(tempfile.mkdtemp(prefix="ember-profile-"))  # 0700: the agent's
        try:
            await self._profile(py_spy, int(pid), folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def _profile(self, py_spy: str, host_pid: int, folder: Path) -> None:
        output = folder / ("profile.svg" if self.spec.format == "flamegraph" else "profile.json")
        native = self.spec.native
        prefix, pid = in_pid_namespace_of(host_pid)
        command = [*prefix, *py_spy_command(py_spy, pid, self.spec, output, native=native)]
        ran = await self._py_spy(command)
        if ran is None:
            return  # timed out: said
        code, dumped, said = ran
        if code != 0 and native:
            # Native unwinding fails on some stacks (libunwind's UNW_EBADREG, say): the
            # Python frames are still worth having.
            why = " ".join(line.strip() for line in said.splitlines() if line.strip())
            await self._say(
                f"py-spy could not unwind native frames here ({why[:240] or 'no reason given'})"
                "; Python frames only\n"
            )
            command = [*prefix, *py_spy_command(py_spy, pid, self.spec, output, native=False)]
            ran = await self._py_spy(command)
            if ran is None:
                return
            code, dumped, said = ran
        if code == 0 and self.spec.mode == "dump":
            await self._output("stdout", dumped)
        elif code == 0:
            if notes := recording_notes(dumped.decode(errors="replace")):
                await self._say(notes)
            await self._send_file(output)
        else:
            await self._output("stderr", said.encode())
        await self._exit(code, None if code == 0 else f"py-spy failed (exit status {code})")

    async def _py_spy(self, command: list[str]) -> tuple[int, bytes, str] | None:
        """Run py-spy: its exit status, what it wrote to stdout (a dump, or a
        recording's progress lines) and to stderr (its errors). None once a timeout was
        said."""
        dump = self.spec.mode == "dump"
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            # Its errors in a line or two, without the Rust backtrace a caller cannot use.
            # The agent's fixed environment (root's, in a replica's PID namespace).
            env={**ROOT_ENV, "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"},
        )
        dumped: list[bytes] = []
        said: list[bytes] = []

        async def pump(stream: asyncio.StreamReader | None, kept: list[bytes]) -> None:
            while stream is not None and (chunk := await stream.read(CHUNK_BYTES)):
                kept.append(chunk)

        pumps = asyncio.gather(pump(process.stdout, dumped), pump(process.stderr, said))
        limit = (0.0 if dump else self.spec.duration) + SLACK_SECONDS
        try:
            async with asyncio.timeout(limit):
                await pumps
                returncode = await process.wait()
        except TimeoutError:
            _kill(process)
            await process.wait()
            await self._exit(EXIT_TIMED_OUT, f"py-spy did not finish within {limit:g} s")
            return None
        except BaseException:
            _kill(process)
            pumps.cancel()
            with contextlib.suppress(BaseException):
                await process.wait()
            raise
        return exit_code(returncode), b"".join(dumped), b"".join(said).decode(errors="replace")

    async def _send_file(self, path: Path) -> None:
        # Whole (a flame graph is some 100 KiB): its title, py-spy's command line, loses
        # the temporary folder the caller never sees.
        data = (await asyncio.to_thread(path.read_bytes)).replace(f"{path.parent}/".encode(), b"")
        for start in range(0, len(data), CHUNK_BYTES):
            await self._output("stdout", data[start : start + CHUNK_BYTES])

    async def _say(self, text: str) -> None:
        await self._output("stderr", text.encode())

    async def _output(self, stream: str, chunk: bytes) -> None:
        data = base64.b64encode(chunk).decode("ascii")
        await self.send(wire.ExecOutput(exec_id=self.exec_id, stream=stream, data=data))

    async def _exit(self, code: int | None, error: str | None) -> None:
        await self.send(wire.ExecExit(exec_id=self.exec_id, exit_code=code, error=error))


def recording_notes(progress: str) -> str:
    """What of py-spy's progress lines the caller needs: its count of samples and errors,
    and how far behind it fell on a busy node (said once, not once a second); not its
    temporary file's name nor its advice on other tools."""
    notes, behind = [], ""
    for line in progress.splitlines():
        text = line.removeprefix("py-spy> ").strip()
        if "behind in sampling" in text:
            behind = text
        elif "Samples:" in text:
            notes.append("py-spy: " + text[text.index("Samples:") :])
    return "".join(f"{note}\n" for note in ([behind] if behind else []) + notes)


def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
