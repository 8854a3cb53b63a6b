"""`ember server` start-to-ready and stop, as the e2e harness sees them.

Each round starts `ember server --state-dir <fresh dir> --port 0` (its local worker
included), times it to the "Press Ctrl+C" line the harness waits for, sends SIGTERM and
times the stop until the server and every process of its group have exited, and
adds up the CPU time the server and its local worker took (what load moves least). The
baseline, run in the same rounds, is a bare `python -c "import ember"`: what any Python
process of the SDK costs on this machine at this moment, so that figures taken on a busy
machine can be read against it.

With --compare DIR (repeatable), rounds alternate between this checkout and the one at
DIR (e.g. `git archive HEAD~3 sdk platform worker | tar -x -C DIR`), whose sdk/,
platform/ and worker/ are put first on PYTHONPATH: before and after side by side, under
the same load. On a shared machine, --first (as root) gives each started server's
session the CPU ahead of other sessions (its autogroup's nice, -20: plain `nice` does not
reach across sessions), for the figures a quiet machine would give. Where
PYTHONDONTWRITEBYTECODE is set, each process compiles Ember's modules from source (about
a third of its CPU): compare checkouts that hold bytecode alike.

    .venv/bin/python bench/startup.py               # 7 rounds
    .venv/bin/python bench/startup.py --quick       # 1 round (after the warm-up one)
    .venv/bin/python bench/startup.py --rounds 11 --compare /tmp/before --first
    .venv/bin/python bench/startup.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from procs import Parts

READY_LINE = "Press Ctrl+C"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def _env(home: Path, tree: Path | None) -> dict[str, str]:
    env = {
        **os.environ,
        "HOME": str(home),
        "EMBER_CONFIG": str(home / "config.json"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("EMBER_TOKEN", None)
    env.pop("EMBER_SERVER_URL", None)
    if tree is not None:
        parts = [str(tree / part) for part in ("sdk", "platform", "worker")]
        env["PYTHONPATH"] = os.pathsep.join([*parts, env.get("PYTHONPATH", "")]).rstrip(":")
    return env


def _group_alive(group: int) -> bool:
    for pid in os.listdir("/proc"):  # not a glob: it fails on a process exiting meanwhile
        if not pid.isdigit():
            continue
        try:
            text = Path("/proc", pid, "stat").read_text()
            state, _ppid, pgrp = text.rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if state not in ("Z", "X") and int(pgrp) == group:
            return True
    return False


def _put_first(pid: int) -> None:
    """Give the session of `pid` (its autogroup) the CPU ahead of other sessions."""
    Path(f"/proc/{pid}/autogroup").write_text("-20")


def server_round(tree: Path | None, first: bool = False) -> tuple[float, float, float]:
    """Seconds to ready, from SIGTERM to the last process of its group gone, and the CPU
    seconds the server and its local worker took in all (the figure load moves least)."""
    with tempfile.TemporaryDirectory(prefix="ember-startup-") as root:
        home = Path(root)
        command = [
            sys.executable,
            "-m",
            "ember.cli.main",
            "server",
            "--state-dir",
            str(home / "state"),
            "--port",
            "0",
        ]
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            env=_env(home, tree),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert process.stdout is not None
        if first:
            _put_first(process.pid)
        output = []
        try:
            for line in process.stdout:
                output.append(line)
                if line.startswith(READY_LINE):
                    break
                if time.monotonic() - started > START_TIMEOUT_S:
                    break
            else:
                raise RuntimeError("ember server exited:\n" + "".join(output))
            ready = time.monotonic() - started
            stopping = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.stdout.read()  # until every writer of the pipe (the worker too) is gone
            # Its usage includes the local worker's, which it waited for.
            _pid, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            while _group_alive(process.pid) and time.monotonic() - stopping < STOP_TIMEOUT_S:
                time.sleep(0.005)
            return ready, time.monotonic() - stopping, usage.ru_utime + usage.ru_stime
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            process.stdout.close()


def import_round(tree: Path | None, first: bool = False) -> float:
    started = time.monotonic()
    env = _env(Path(tempfile.gettempdir()), tree)
    process = subprocess.Popen(
        [sys.executable, "-c", "import ember"], env=env, start_new_session=True
    )
    if first:
        _put_first(process.pid)
    if process.wait() != 0:
        raise RuntimeError("python -c 'import ember' failed")
    return time.monotonic() - started


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p90": p90}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds (7; quick 1)")
    parser.add_argument(
        "--compare", type=Path, action="append", default=[], help="another checkout, alternated"
    )
    parser.add_argument(
        "--first", action="store_true", help="servers' sessions take the CPU first (root)"
    )
    parser.add_argument("--quick", action="store_true", help="one round after the warm-up")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.quick else 7
    trees: dict[str, Path | None] = {"this": None}
    for tree in args.compare:
        trees[tree.name] = tree.resolve()
    figures: dict[str, dict[str, list[float]]] = {
        name: {"ready": [], "stop": [], "cpu": [], "import ember": []} for name in trees
    }
    parts = Parts("bench/startup.py")
    failed = None
    try:
        for name, tree in trees.items():
            parts.now = f"the warm-up round of {name}"
            server_round(tree, args.first)  # warms the page cache
        for round_no in range(args.rounds):
            for name, tree in trees.items():
                parts.now = f"round {round_no + 1} of {name}"
                ready, stop, cpu = server_round(tree, args.first)
                figures[name]["ready"].append(ready)
                figures[name]["stop"].append(stop)
                figures[name]["cpu"].append(cpu)
                figures[name]["import ember"].append(import_round(tree, args.first))
                if not args.json:
                    print(
                        f"round {round_no + 1} {name:10} ready {ready:6.3f} s  "
                        f"stop {stop:6.3f} s  cpu {cpu:6.3f} s",
                        file=sys.stderr,
                    )
    except Exception as error:
        failed = error
    result: dict[str, Any] = {
        name: {what: _summary(values) for what, values in rows.items() if values}
        for name, rows in figures.items()
    }
    if failed is not None:
        result["failed"] = parts.line(failed)
    if args.json:
        print(json.dumps(result, indent=2), flush=True)
    else:
        for name, tree in trees.items():
            print("this checkout:" if tree is None else f"{tree}:")
            for what, stats in result[name].items():
                print(f"  {what:13} median {stats['median']:6.3f} s   p90 {stats['p90']:6.3f} s")
        sys.stdout.flush()
    if failed is not None:
        parts.say(failed)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
