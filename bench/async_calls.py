"""asyncio calls with the connections their event loop keeps, against a new client per
call (what `acall` did before), in the same run.

One `ember server` with a no-op async endpoint (one replica, concurrency 64). Both sides
run in this process's one event loop on uvloop, alternating round by round: `kept` is
`Endpoint.acall`, whose client lives as long as the loop; `fresh` opens an
`httpx.AsyncClient` for each call (its own TLS handshake) and closes it after. Reported:
calls/s and p50 latency at 1 call at a time and at 16 in flight, and kept/fresh.

    .venv/bin/python bench/async_calls.py          # about a minute
    .venv/bin/python bench/async_calls.py --quick  # one round of 100 calls
    .venv/bin/python bench/async_calls.py --json

A run that fails part-way prints the rounds it finished, and where it failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from procs import isolated_env, platform_with_app, progress, stopped_at_exit

APP = "asyncbench"
NOOP_APP = """\
import ember


@ember.endpoint(concurrency=64, max_replicas=1, scaledown_window=600)
async def noop(n: int = 0) -> dict:
    return {"n": n}
"""

Call = Callable[[int], Awaitable[Any]]


async def measure(call: Call, in_flight: int, calls: int) -> dict[str, float]:
    """`calls` calls, `in_flight` at a time; calls/s and the median latency."""
    latencies: list[float] = []
    queue = iter(range(calls))

    async def lane() -> None:
        for n in queue:
            began = time.perf_counter()
            answer = await call(n)
            latencies.append(time.perf_counter() - began)
            if answer != {"n": n}:
                raise RuntimeError(f"call {n} answered {answer!r}")

    began = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(in_flight)))
    elapsed = time.perf_counter() - began
    return {"calls_per_s": calls / elapsed, "p50_ms": statistics.median(latencies) * 1e3}


async def compare(endpoint: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills result["rounds"] as each side's round at each load ends."""
    from ember.calling.call_bodies import call_body
    from ember.calling.connections import async_platform_client, request_timeout

    config = endpoint._config

    async def kept(n: int) -> Any:
        return await endpoint.acall(n=n)

    async def fresh(n: int) -> Any:
        async with async_platform_client(config, None) as client:
            response = await client.post(
                endpoint.url, **call_body({"n": n}, {}), timeout=request_timeout(60.0)
            )
            return response.json()

    sides: dict[str, Call] = {"kept": kept, "fresh": fresh}
    rounds: dict[str, dict[str, list[dict[str, float]]]] = result["rounds"]
    result["failed"] = {"part": "warming up", "error": ""}  # until each part is done
    for side in sides.values():  # warm: the replica, the kept client, imports
        await measure(side, 4, 40)
    for number in range(args.rounds):
        progress(args.quiet, f"round {number + 1}/{args.rounds}")
        order = list(sides) if number % 2 == 0 else list(reversed(sides))
        for name in order:
            for in_flight in args.in_flight:
                result["failed"]["part"] = f"round {number + 1}, {name}, {in_flight} in flight"
                rounds[name].setdefault(str(in_flight), []).append(
                    await measure(sides[name], in_flight, args.calls)
                )
    del result["failed"]


def summarize(rounds: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """Medians over the rounds of each side at each load, and kept/fresh: of the loads
    both sides have rounds of (all of them, unless the run failed)."""
    summary: dict[str, Any] = {}
    for in_flight in rounds["kept"]:
        if not rounds["fresh"].get(in_flight):
            continue
        row: dict[str, Any] = {}
        for name in ("kept", "fresh"):
            measured = rounds[name][in_flight]
            row[name] = {
                key: statistics.median(r[key] for r in measured)
                for key in ("calls_per_s", "p50_ms")
            }
        row["throughput_ratio"] = row["kept"]["calls_per_s"] / row["fresh"]["calls_per_s"]
        row["p50_ratio"] = row["kept"]["p50_ms"] / row["fresh"]["p50_ms"]
        summary[in_flight] = row
    return summary


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import ember
    from ember.calling import eventloop

    result["rounds"] = {"kept": {}, "fresh": {}}
    with tempfile.TemporaryDirectory(prefix="ember-bench-async-") as tmp:
        work = Path(tmp)
        (work / "app").mkdir()
        (work / "app" / "app.py").write_text(NOOP_APP)
        env = isolated_env(work)
        with stopped_at_exit() as started:
            result["failed"] = {"part": "starting the platform", "error": ""}
            progress(args.quiet, "starting ember server ...")
            server, config = platform_with_app(work, work / "app" / "app.py", APP, env, started)
            endpoint = ember.Endpoint.lookup(APP, "noop", config=config)
            server.remember()
            del result["failed"]
            eventloop.run(compare(endpoint, args, result))


def report(summary: dict[str, Any], failed: dict[str, str] | None) -> str:
    lines = [
        "asyncio calls: connections kept per event loop against a new client per call",
        "",
        f"{'in flight':>10}{'side':>8}{'calls/s':>10}{'p50 (ms)':>10}",
    ]
    for in_flight, row in summary.items():
        for name in ("kept", "fresh"):
            side = row[name]
            lines.append(
                f"{in_flight:>10}{name:>8}{side['calls_per_s']:>10.0f}{side['p50_ms']:>10.2f}"
            )
        lines.append(
            f"{'':>10}{'kept/fresh':>18}: {row['throughput_ratio']:.2f}x calls/s, "
            f"{row['p50_ratio']:.2f}x p50"
        )
    if failed:
        lines += ["", f"FAILED in {failed['part']}: {failed['error']}"]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, help="calls per side, round and load (400; quick 100)")
    parser.add_argument("--rounds", type=int, help="rounds, the sides alternating (3; quick 1)")
    parser.add_argument(
        "--in-flight", type=int, nargs="+", default=[1, 16], help="calls in flight at once"
    )
    parser.add_argument("--quick", action="store_true", help="one round of 100 calls a load")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    for name, (full, quick) in {"calls": (400, 100), "rounds": (3, 1)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; the server and its processes are stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # what the finished rounds measured is printed all the same
        failed = result.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(exc).__name__}: {exc}"
    summary = summarize(result.get("rounds") or {"kept": {}, "fresh": {}})
    failed = result.get("failed")
    if args.json:
        print(json.dumps(summary | ({"failed": failed} if failed else {}), indent=2))
    else:
        print(report(summary, failed))
    if failed:
        print(f"bench/async_calls.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
