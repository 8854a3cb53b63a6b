"""Affinity routing: multi-turn chats over two replicas that each cache their sessions'
prefixes, with and without the session as the calls' affinity key, in the same run.

The endpoint stands in for an LLM server's prefix cache: each replica remembers how much
of each session's conversation it has prefilled. A call prefills what its replica lacks
(`--prefill-ms` a token, one prefill at a time per replica, as prefills take a whole
accelerator), then decodes its answer (`--decode-ms` a token, shared by the calls at
once, as batched decoding is). The time is slept, not computed, as on a GPU whose work
does not compete with the platform for these CPUs: what is measured is where the
platform sends each call. Both runs send the same conversations with the same pauses
between turns (`--think-s`, exponential); each run's sessions are new to the replicas.

Reported for each run: the prefix reuse rate (of the conversation before each turn, the
share its replica had cached), latency per call at P50, P95 and P99, and calls/s; then
the keyed run's ratios to the plain one.

    .venv/bin/python bench/affinity.py          # about 40 s
    .venv/bin/python bench/affinity.py --quick  # 12 chats x 3 turns, shorter pauses
    .venv/bin/python bench/affinity.py --json   # machine-readable

A run that fails part-way prints what the runs before measured, and which run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from procs import isolated_env, platform_with_app, progress, stopped_at_exit

APP = "affinity"

CHAT_APP = """\
import threading
import time

import ember

PREFILL_S = %(prefill_ms)s / 1000
DECODE_S = %(decode_ms)s / 1000
_cached: dict[str, int] = {}  # session -> tokens of its conversation this replica holds
_lock = threading.Lock()
_compute = threading.Lock()  # prefills take the whole accelerator: one at a time


@ember.endpoint(
    min_replicas=2, max_replicas=2, concurrency=8, target_concurrency=4, scaledown_window=600
)
def chat(session: str, history: int, new_tokens: int) -> dict:
    with _lock:
        reused = min(_cached.get(session, 0), history)
    with _compute:
        time.sleep((history - reused) * PREFILL_S)
    time.sleep(new_tokens * DECODE_S)  # decoding is batched: calls share its steps
    with _lock:
        _cached[session] = history + new_tokens  # its answer is part of the next prompt
    return {"reused": reused}
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Affinity routing against plain routing: prefix reuse and latency of "
        "multi-turn chats over two replicas, in one run.",
    )
    parser.add_argument("--sessions", type=int, help="conversations (24; quick 12)")
    parser.add_argument("--turns", type=int, help="calls per conversation (6; quick 3)")
    parser.add_argument(
        "--think-s", type=float, help="mean pause between turns, exponential (1.5; quick 0.3)"
    )
    parser.add_argument(
        "--turn-tokens", type=int, default=300, help="prompt tokens each turn adds (300)"
    )
    parser.add_argument("--new-tokens", type=int, default=32, help="answer tokens (32)")
    parser.add_argument("--prefill-ms", type=float, default=0.2, help="per token (0.2)")
    parser.add_argument("--decode-ms", type=float, default=2.0, help="per token (2)")
    parser.add_argument("--seed", type=int, default=0, help="of the pauses (0)")
    parser.add_argument(
        "--quick", action="store_true", help="fewer, shorter chats: both runs in seconds"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    # A second turn at least: the first has nothing to reuse.
    defaults = {"sessions": (24, 12), "turns": (6, 3), "think_s": (1.5, 0.3)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def conversation(
    endpoint: Any, session: str, index: int, args: argparse.Namespace, keyed: bool
) -> list[dict[str, float]]:
    """One chat, turn after turn with a pause before each (the user reading and typing):
    each prompt is the whole conversation so far. The same pauses in both runs."""
    pauses = random.Random(args.seed * 100_003 + index)
    history = 0
    calls = []
    for _ in range(args.turns):
        time.sleep(pauses.expovariate(1 / args.think_s))
        history += args.turn_tokens
        began = time.perf_counter()
        answer = endpoint.call(
            session=session,
            history=history,
            new_tokens=args.new_tokens,
            _affinity=session if keyed else None,
        )
        calls.append(
            {
                "reusable": history - args.turn_tokens,  # all but the new turn
                "reused": answer["reused"],
                "latency_s": time.perf_counter() - began,
            }
        )
        history += args.new_tokens
    return calls


def measure(endpoint: Any, args: argparse.Namespace, keyed: bool) -> dict[str, Any]:
    run = "keyed" if keyed else "plain"
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.sessions) as pool:
        chats = list(
            pool.map(
                lambda n: conversation(endpoint, f"{run}-{n}", n, args, keyed),
                range(args.sessions),
            )
        )
    elapsed = time.perf_counter() - began
    calls = [call for chat in chats for call in chat]
    latencies = sorted(call["latency_s"] for call in calls)
    return {
        "calls": len(calls),
        "seconds": elapsed,
        "calls_per_s": len(calls) / elapsed,
        # Of what an earlier turn left to reuse, the share the call's replica had.
        "reuse_rate": sum(c["reused"] for c in calls) / sum(c["reusable"] for c in calls),
        "p50_s": statistics.median(latencies),
        "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
    }


@contextlib.contextmanager
def part(result: dict[str, Any], name: str) -> Iterator[None]:
    """Notes in `result` the part a failure in the block happened in, for the report."""
    try:
        yield
    except BaseException as exc:
        result.setdefault("failed", {"part": name, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills `result` run by run, so that a failure leaves what the runs before measured."""
    import ember

    result["settings"] = {
        key: value for key, value in vars(args).items() if key not in ("json", "quiet")
    }
    with tempfile.TemporaryDirectory(prefix="ember-bench-affinity-") as tmp:
        work = Path(tmp)
        (work / "app").mkdir()
        (work / "app" / "app.py").write_text(
            CHAT_APP % {"prefill_ms": args.prefill_ms, "decode_ms": args.decode_ms}
        )
        env = isolated_env(work)
        with stopped_at_exit() as started:
            with part(result, "starting the platform"):
                progress(args.quiet, "starting ember server ...")
                server, config = platform_with_app(work, work / "app" / "app.py", APP, env, started)
                endpoint = ember.Endpoint.lookup(APP, "chat", config=config)
                endpoint.call(session="warm", history=1, new_tokens=1)
                server.remember()
            with part(result, "plain"):
                progress(
                    args.quiet, f"{args.sessions} chats x {args.turns} turns, without keys ..."
                )
                result["plain"] = measure(endpoint, args, keyed=False)
            with part(result, "keyed"):
                progress(args.quiet, "the same chats with the session as the affinity key ...")
                result["keyed"] = measure(endpoint, args, keyed=True)
            server.remember()
    plain, keyed = result["plain"], result["keyed"]
    result["p50_ratio"] = plain["p50_s"] / keyed["p50_s"]
    result["p95_ratio"] = plain["p95_s"] / keyed["p95_s"]
    result["throughput_ratio"] = keyed["calls_per_s"] / plain["calls_per_s"]


def report(result: dict[str, Any]) -> str:
    lines = ["affinity routing: multi-turn chats over 2 replicas caching their prefixes", ""]
    lines.append(f"{'':8}{'reuse':>8}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'calls/s':>10}")
    for name in ("plain", "keyed"):
        if name not in result:  # the run failed, or one before it
            continue
        run = result[name]
        lines.append(
            f"{name:8}{run['reuse_rate']:>8.0%}{run['p50_s'] * 1000:>10.1f}"
            f"{run['p95_s'] * 1000:>10.1f}{run['p99_s'] * 1000:>10.1f}"
            f"{run['calls_per_s']:>10.1f}"
        )
    if "throughput_ratio" in result:
        lines += [
            "",
            f"keyed vs plain: latency {result['p50_ratio']:.2f}x lower at p50, "
            f"{result['p95_ratio']:.2f}x at p95; throughput {result['throughput_ratio']:.2f}x",
        ]
    if "failed" in result:
        failed = result["failed"]
        lines += ["", f"FAILED in {failed['part']}: {failed['error']}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; the server and its processes are stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # any failure: what was measured is printed all the same
        result.setdefault("failed", {"part": "the run", "error": f"{type(exc).__name__}: {exc}"})
    print(json.dumps(result, indent=2) if args.json else report(result))
    if "failed" in result:
        failed = result["failed"]
        print(f"bench/affinity.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
