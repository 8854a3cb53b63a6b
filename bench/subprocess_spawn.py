"""asyncio subprocesses on Ember's loop (`ember.loop_subprocesses`: Popen, a pidfd)
against uvloop's own, in the same run: the time from `create_subprocess_exec` of `true`
with a stdout pipe to its `communicate()` returning, p50 by round, the targets
alternating round by round, asyncio's own loop alongside for reference; and how many
children ran Python between fork and exec (an at-fork hook counts them), which is what
made uvloop's unsafe in a process with threads.

    .venv/bin/python bench/subprocess_spawn.py            # a few seconds
    .venv/bin/python bench/subprocess_spawn.py --quick    # one round of 50 children
    .venv/bin/python bench/subprocess_spawn.py --json

Exit status 0, 1 if any of Ember's children ran Python, 2 when a round failed (what the
rounds before it measured is printed first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from procs import Parts

from ember.calling import eventloop

Factory = Callable[[], asyncio.AbstractEventLoop] | None


class PythonInChildren:
    """Counts forked children that run Python, through a pipe an at-fork hook writes to."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.read_end, False)
        os.register_at_fork(after_in_child=lambda: os.write(self.write_end, b"x"))

    def take(self) -> int:
        try:
            return len(os.read(self.read_end, 1 << 20))
        except BlockingIOError:
            return 0


async def spawns(count: int) -> list[float]:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        child = await asyncio.create_subprocess_exec("true", stdout=asyncio.subprocess.PIPE)
        await child.communicate()
        times.append(time.perf_counter() - began)
    return times


def measure(factory: Factory, count: int, probe: PythonInChildren) -> tuple[float, int]:
    probe.take()
    with asyncio.Runner(loop_factory=factory) as runner:
        times = runner.run(spawns(count))
    return statistics.median(times), probe.take()


def summarize(
    p50s: dict[str, list[float]], ran_python: dict[str, int], spawns: int
) -> dict[str, Any]:
    """Each loop's figures over the rounds it ran; the ratio once both loops have one."""
    summary: dict[str, Any] = {
        name: {
            "p50_ms": statistics.median(values) * 1000,
            "by_round_ms": [round(v * 1000, 3) for v in values],
            "children": len(values) * spawns,
            "children_that_ran_python": ran_python[name],
        }
        for name, values in p50s.items()
        if values
    }
    if "ember" in summary and "uvloop" in summary:
        summary["ember_over_uvloop"] = summary["ember"]["p50_ms"] / summary["uvloop"]["p50_ms"]
    return summary


def report(summary: dict[str, Any]) -> str:
    lines = []
    for name, row in summary.items():
        if not isinstance(row, dict):
            continue
        rounds = ", ".join(f"{v:.2f}" for v in row["by_round_ms"])
        lines.append(
            f"{name:8} {row['p50_ms']:.2f} ms p50 spawn to exit [by round: {rounds}]; "
            f"{row['children_that_ran_python']} of {row['children']} children ran Python "
            "before exec"
        )
    if "ember_over_uvloop" in summary:
        lines.append(f"ember/uvloop: {summary['ember_over_uvloop']:.2f}x the time")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds per loop (5; quick 1)")
    parser.add_argument(
        "--spawns", type=int, default=None, help="children per round (200; quick 50)"
    )
    parser.add_argument("--quick", action="store_true", help="one round of 50 children")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    for name, (full, quick) in {"rounds": (5, 1), "spawns": (200, 50)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    try:
        import uvloop
    except ImportError:
        print("subprocess_spawn.py: uvloop is not installed: nothing to compare", file=sys.stderr)
        return 2
    ember_loop = eventloop.loop_factory()
    targets: dict[str, Factory] = {
        "ember": ember_loop,
        "uvloop": uvloop.new_event_loop,
        "asyncio": None,
    }
    probe = PythonInChildren()
    p50s: dict[str, list[float]] = {name: [] for name in targets}
    ran_python: dict[str, int] = dict.fromkeys(targets, 0)
    parts = Parts("bench/subprocess_spawn.py")
    failed = None
    try:
        for number in range(args.rounds):
            for name, factory in targets.items():
                parts.now = f"round {number + 1}, {name}'s loop"
                p50, python = measure(factory, args.spawns, probe)
                p50s[name].append(p50)
                ran_python[name] += python
    except Exception as error:
        failed = error
    summary = summarize(p50s, ran_python, args.spawns)
    if failed is not None:
        summary["failed"] = parts.line(failed)
    print(json.dumps(summary, indent=2) if args.json else report(summary), flush=True)
    if failed is not None:
        parts.say(failed)
        return 2
    return 0 if ran_python["ember"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
