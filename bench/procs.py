"""Process helpers the benchmarks share: find what `ember server` started, and stop it."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

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
