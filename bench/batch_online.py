"""Online TTFT with and without a Batch API batch on the same endpoint, in one run.

One endpoint serving OpenAI's chat completions (a stand-in engine: a prefill that takes
the accelerator alone, then decoding steps that calls share) at a fixed number of
replicas, called online at a fixed Poisson rate with streamed requests: first alone,
then while a batch of many requests runs on it. Printed: the online calls' TTFT P50/P99
in both phases and their ratio, errors, and the batch requests finished per second while
the online load ran (what the idle capacity gave the batch). Reach (issue 52): online
P99 TTFT with the batch <= 1.25x alone, no online error, and the batch progressing.

    .venv/bin/python bench/batch_online.py           # about 1 minute
    .venv/bin/python bench/batch_online.py --json
    .venv/bin/python bench/batch_online.py --quick   # 6 s a phase
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from procs import (
    Parts,
    fill_defaults,
    isolated_env,
    platform_with_app,
    progress,
    stopped_at_exit,
)

from ember.calling.tlsclient import client_context

APP = "batchbench"
LABEL = f"{APP}--chat"
REACH_P99_RATIO = 1.25
CHAT_APP = """\
import threading
import time
from typing import Any

import ember

PREFILL_S = %(prefill_ms)s / 1000
STEP_S = %(step_ms)s / 1000
PRIORITY_SCHEDULING = %(priority_scheduling)s


# A prefill takes the accelerator alone; with priority scheduling (as vLLM's
# scheduling_policy "priority"), a waiting online prefill goes before a batch's.
class Accelerator:

    def __init__(self) -> None:
        self._free = threading.Condition()
        self._busy = False
        self._online_waiting = 0

    def prefill(self) -> None:
        low = PRIORITY_SCHEDULING and ember.current_priority() == "low"
        with self._free:
            self._online_waiting += not low
            while self._busy or (low and self._online_waiting):
                self._free.wait()
            self._online_waiting -= not low
            self._busy = True
        time.sleep(PREFILL_S)
        with self._free:
            self._busy = False
            self._free.notify_all()


_accelerator = Accelerator()


@ember.endpoint(
    min_replicas=%(replicas)s, max_replicas=%(replicas)s, concurrency=%(concurrency)s
)
class Chat:
    @ember.method(path="v1/chat/completions", stream_flag="stream", stream_done=True)
    def chat(self, **request: Any) -> Any:
        tokens = int(request.get("max_tokens", 8))

        def steps():
            _accelerator.prefill()
            for n in range(tokens):
                yield {"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
                time.sleep(STEP_S)  # decoding steps are shared: no lock

        if request.get("stream"):
            return steps()
        count = sum(1 for _ in steps())
        return {"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x" * count},
             "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": count, "total_tokens": count + 8}}
"""

QUIET = False


def say(message: str) -> None:
    progress(QUIET, message)


def body(tokens: int, stream: bool) -> dict[str, Any]:
    content = "Summarise this record in one line."
    return {
        "model": "stand-in",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "stream": stream,
    }


async def online_load(
    client: httpx.AsyncClient, rate: float, seconds: float, tokens: int, seed: int
) -> dict[str, Any]:
    """Streamed calls at Poisson arrivals for `seconds`: each one's TTFT, and errors."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    errors: list[str] = []

    async def one() -> None:
        sent = time.perf_counter()
        try:
            async with client.stream(
                "POST", f"/{LABEL}/v1/chat/completions", json=body(tokens, True)
            ) as answer:
                if answer.status_code != 200:
                    errors.append(f"{answer.status_code}: {(await answer.aread())[:200]!r}")
                    return
                first = None
                async for line in answer.aiter_lines():  # read to its end, as a client does
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter() - sent
                if first is not None:
                    ttfts.append(first)
        except httpx.HTTPError as error:
            errors.append(f"{type(error).__name__}: {error}")

    tasks = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    ttfts.sort()
    return {
        "calls": len(tasks),
        "errors": errors[:5],
        "error_count": len(errors),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else None,
    }


def start_batch(client: httpx.Client, requests: int, tokens: int) -> str:
    lines = (
        json.dumps(
            {
                "custom_id": f"r{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": body(tokens, False),
            }
        )
        for n in range(requests)
    )
    data = "\n".join(lines).encode()
    made = client.post(
        f"/{LABEL}/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
    )
    made.raise_for_status()
    batch = client.post(
        f"/{LABEL}/v1/batches",
        json={
            "input_file_id": made.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    batch.raise_for_status()
    batch_id: str = batch.json()["id"]
    return batch_id


def batch_counts(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    answer = client.get(f"/{LABEL}/v1/batches/{batch_id}")
    answer.raise_for_status()
    document: dict[str, Any] = answer.json()
    return document


async def phase(config: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    async with httpx.AsyncClient(
        base_url=config.server_url,
        verify=client_context(config.ca_cert),
        headers={"Authorization": f"Bearer {config.token}"},
        timeout=60,
        limits=httpx.Limits(max_connections=200),
    ) as client:
        return await online_load(client, args.rate, args.seconds, args.tokens, seed)


def run(args: argparse.Namespace, parts: Parts, result: dict[str, Any]) -> None:
    work = Path(tempfile.mkdtemp(prefix="ember-batch-bench-"))
    try:
        _run(args, work, parts, result)
    finally:  # its platform's state
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path, parts: Parts, result: dict[str, Any]) -> None:
    app_file = work / "batchbench.py"
    app_file.write_text(
        CHAT_APP
        % {
            "prefill_ms": args.prefill_ms,
            "step_ms": args.step_ms,
            "replicas": args.replicas,
            "concurrency": args.concurrency,
            "priority_scheduling": not args.fifo_engine,
        }
    )
    result["setup"] = {
        key: getattr(args, key)
        for key in ("rate", "seconds", "tokens", "replicas", "concurrency", "prefill_ms")
    } | {
        "step_ms": args.step_ms,
        "batch_requests": args.batch_requests,
        "engine": "fifo" if args.fifo_engine else "priority",
    }
    with stopped_at_exit() as started:
        parts.now = "starting the platform"
        say("ember server, the endpoint deployed ...")
        _, config = platform_with_app(work, app_file, APP, isolated_env(work), started)
        headers = {"Authorization": f"Bearer {config.token}"}
        with httpx.Client(
            base_url=config.server_url,
            verify=client_context(config.ca_cert),
            headers=headers,
            timeout=120,
        ) as client:
            parts.now = "warming up"
            asyncio.run(online_load_briefly(config, args))
            parts.now = "online alone"
            say(f"online alone: {args.rate:g}/s for {args.seconds:g} s ...")
            result["alone"] = asyncio.run(phase(config, args, args.seed))
            parts.now = "online beside a batch"
            batch_id = start_batch(client, args.batch_requests, args.tokens)
            time.sleep(1.0)  # the batch fills the idle slots
            before = batch_counts(client, batch_id)["request_counts"]
            say(f"online beside a batch of {args.batch_requests} requests ...")
            began = time.perf_counter()
            beside = asyncio.run(phase(config, args, args.seed))
            spent = time.perf_counter() - began
            after = batch_counts(client, batch_id)["request_counts"]
            beside["batch_per_s"] = (after["completed"] - before["completed"]) / spent
            beside["batch_failed"] = after["failed"]
            result["beside_batch"] = beside
            client.post(f"/{LABEL}/v1/batches/{batch_id}/cancel").raise_for_status()


async def online_load_briefly(config: Any, args: argparse.Namespace) -> None:
    warm = argparse.Namespace(**{**vars(args), "seconds": 1.0})
    await phase(config, warm, args.seed + 1)


def verdicts(result: dict[str, Any]) -> dict[str, bool | None]:
    alone, beside = result.get("alone"), result.get("beside_batch")
    if not alone or not beside or alone["ttft_p99_s"] is None or beside["ttft_p99_s"] is None:
        return {"p99": None, "errors": None, "batch": None}
    return {
        "p99": beside["ttft_p99_s"] <= REACH_P99_RATIO * alone["ttft_p99_s"],
        "errors": alone["error_count"] == 0 and beside["error_count"] == 0,
        "batch": beside["batch_per_s"] > 0 and beside["batch_failed"] == 0,
    }


def mark(passed: bool | None) -> str:
    return "not measured" if passed is None else ("PASS" if passed else "MISS")


def report(result: dict[str, Any]) -> str:
    lines = ["online TTFT beside a Batch API batch, one endpoint"]
    setup = result.get("setup")
    if setup:
        lines.append(
            f"  {setup['replicas']} replica(s) x {setup['concurrency']} slots; online "
            f"{setup['rate']:g}/s streamed for {setup['seconds']:g} s a phase, "
            f"{setup['tokens']} tokens; prefill {setup['prefill_ms']:g} ms alone on the "
            f"accelerator ({setup['engine']} order), {setup['step_ms']:g} ms a step"
        )
    lines.append(f"{'phase':<14}{'calls':>7}{'errors':>8}{'TTFT P50':>11}{'TTFT P99':>11}")
    for name, key in (("alone", "alone"), ("beside batch", "beside_batch")):
        side = result.get(key)
        if not side or side["ttft_p50_s"] is None:
            lines.append(f"{name:<14}{'-':>7}")
            continue
        lines.append(
            f"{name:<14}{side['calls']:>7}{side['error_count']:>8}"
            f"{side['ttft_p50_s'] * 1000:>9.1f}ms{side['ttft_p99_s'] * 1000:>9.1f}ms"
        )
    verdict = result["verdicts"]
    beside = result.get("beside_batch")
    if verdict["p99"] is not None and beside is not None:
        ratio = beside["ttft_p99_s"] / result["alone"]["ttft_p99_s"]
        lines.append(
            f"online TTFT P99 beside the batch: {ratio:.2f}x alone (reach <= "
            f"{REACH_P99_RATIO:g}x): {mark(verdict['p99'])}"
        )
        lines.append(f"online errors: {mark(verdict['errors'])}")
        lines.append(
            f"batch: {beside['batch_per_s']:.1f} requests/s finished beside the online load, "
            f"{beside['batch_failed']} failed: {mark(verdict['batch'])}"
        )
    else:
        lines.append(f"verdicts: {mark(None)}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="online calls/s (10)")
    parser.add_argument("--seconds", type=float, help="each phase (30; quick 6)")
    parser.add_argument("--tokens", type=int, default=8, help="per answer (8)")
    parser.add_argument("--replicas", type=int, default=1, help="(1)")
    parser.add_argument("--concurrency", type=int, default=8, help="slots a replica (8)")
    parser.add_argument("--prefill-ms", type=float, default=5.0, help="(5)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="(10)")
    parser.add_argument("--batch-requests", type=int, help="(5000; quick 1000)")
    parser.add_argument(
        "--fifo-engine",
        action="store_true",
        help="the stand-in engine prefills in arrival order, blind to ember.current_priority()",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="6 s a phase: every verdict printed, none judged by the exit status",
    )
    defaults = {"seconds": (30.0, 6.0), "batch_requests": (5000, 1000)}
    return fill_defaults(parser.parse_args(argv), defaults)


def main(argv: Sequence[str] | None = None) -> int:
    global QUIET
    args = parse_args(argv)
    QUIET = args.quiet
    parts = Parts("bench/batch_online.py")
    result: dict[str, Any] = {}
    failed: Exception | None = None
    try:
        run(args, parts, result)
    except KeyboardInterrupt:
        print("interrupted; the server and its processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the phases before measured is printed all the same
        failed = error
    result["verdicts"] = verdicts(result)
    if parts.show(result, failed, args.json, report):
        return 2
    if args.quick:
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
