"""`ember bench TARGET`: drive load at an endpoint and report what callers see."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ember.calling.tlsclient import client_context
from ember.cli.common import OutputFile, admin_client, output_file
from ember.config import load_config
from ember.errors import EmberError, InvalidError
from ember.loadgen.fit import (
    MAX_TOKENS_NAMES,
    Accepts,
    accepts_of,
    check_requests,
    example_body,
    with_max_tokens,
)
from ember.loadgen.plot import plot_latencies
from ember.loadgen.prompts import (
    argument_stream,
    load_prompt_file,
    merge_arguments,
    parse_arguments,
    read_text_file,
)
from ember.loadgen.report import build_report, format_report
from ember.loadgen.runner import FatalLoadError, LoadPlan, LoadResult, run_load
from ember.loadgen.slo import Slos, parse_slos
from ember.loadgen.target import Target, check_target, parse_target
from ember.progress import Progress
from ember.wire.labels import split_app_key, split_label

REQUESTS_FAILED = 1  # the run happened, and some requests failed (see --allow-failures)
SETUP_FAILED = 2  # unknown endpoint, wrong token, server down, bad options
INTERRUPTED = 130

DEFAULT_MAX_TOKENS = {"chat": 128, "agent": 1024, "batch": 256}
DEFAULT_CHAT_RATE = 2.0
DEFAULT_AGENT_CONCURRENCY = 4
DEFAULT_BATCH_CONCURRENCY = 16
DEFAULT_NUM_REQUESTS = 100

DESCRIPTION = """\
Drive load at a deployed endpoint through the HTTPS gateway (with the client config that
`ember call` uses) and report what callers see: requests/s, output tokens/s, and time to
first token (TTFT), inter-token latency (ITL), time per output token (TPOT) and end-to-end
latency (E2E) at mean, P50, P95 and P99, plus goodput under SLOs.

Workloads:
  chat   Poisson arrivals at --rate requests/s (default 2), streamed: TTFT and ITL matter
  agent  long outputs (--max-tokens 1024); --rate arrivals or --concurrency N (default 4):
         time to the last token matters
  batch  --concurrency N requests (default 16) always in flight, no pacing: throughput

A streaming endpoint's events are its output tokens (an event whose JSON has token_ids or
token_id counts those); a non-streaming answer is one token, so its TTFT is its E2E. A
method that streams when a call asks (OpenAI's "stream") is asked to. METHOD may be a
method's path, such as v1/chat/completions. For a web app (@ember.asgi_app() or
@ember.wsgi_app()) it is the path of a route that takes the POST, and its answers are timed
the same way: server-sent events are tokens (OpenAI's closing [DONE] is not one), any other
body is one token.
Synthetic requests fit the method, as the platform describes its parameters: a chat
method (OpenAI's v1/chat/completions, or one that takes `messages`) gets
{"messages": [{"role": "user", "content": "<--input-len words>"}], "max_tokens": N}, any
other {"prompt": "<--input-len words>", "max_tokens": N} (max_tokens under the name the
method takes: max_completion_tokens or max_new_tokens; left out if it takes none). A
method that takes neither is refused before anything is sent, with what it takes: give
it --body JSON (one request, sent every time), --body-file FILE.json, or --prompts
FILE.jsonl (one request a line, used in turn). --args adds or overrides keyword
arguments, and drops those it sets to null. --max-tokens applies to every source.

Requests are checked against the method's parameters before the run. The run exits 1 if
any request failed (after printing the report and the first errors) unless
--allow-failures."""

EPILOG = """\
examples:
  ember bench myapp/llm --workload chat --rate 4 --num-requests 200 --slo ttft=500ms,itl=50ms
  ember bench myapp/llm/generate --workload batch --concurrency 32 --duration 60 --json
  ember bench myapp/llm --prompts prompts.jsonl --workload agent --plot latency.png
  ember bench hello/greet --workload batch --body '{"name": "Ada"}'
  ember bench llm/llm/v1/chat/completions --prompts chats.jsonl   # {"messages": [...]} lines
  ember bench web/api/v1/completions --args '{"stream": true}'     # a web app's route

Ctrl+C stops the run, reports what finished and exits 130. Exit status 1: some requests
failed (unless --allow-failures); 2: the endpoint cannot be loaded (unknown, wrong token,
server down), an option is wrong or the method cannot take the requests."""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench",
        help="load-test an endpoint and report latency and throughput",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target",
        metavar="APP/ENDPOINT[/METHOD]",
        help="the endpoint: APP/ENDPOINT[/METHOD], APP--ENDPOINT[/METHOD] or its URL; "
        "for a web app, METHOD is a route's path",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--workload", choices=("chat", "agent", "batch"), default="chat")
    load.add_argument(
        "--rate",
        type=_positive_float,
        metavar="R",
        help="Poisson arrivals per second (chat, agent)",
    )
    load.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="N",
        help="requests in flight (batch, agent); with --rate, the most in flight at once",
    )
    amount = load.add_mutually_exclusive_group()
    amount.add_argument(
        "--num-requests",
        type=_positive_int,
        metavar="N",
        help=f"requests to send (default {DEFAULT_NUM_REQUESTS})",
    )
    amount.add_argument(
        "--duration", type=_positive_float, metavar="SECONDS", help="send requests for this long"
    )
    load.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seeds arrivals and prompts (0)"
    )
    load.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        metavar="SECONDS",
        help="give up on a silent request after this long (600)",
    )
    requests = parser.add_argument_group("requests")
    source = requests.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE.jsonl",
        help="one JSON object of keyword arguments per line, used in turn",
    )
    source.add_argument(
        "--body",
        metavar="JSON",
        help='one request\'s keyword arguments, sent every time, e.g. \'{"name": "Ada"}\'',
    )
    source.add_argument(
        "--body-file",
        type=Path,
        metavar="FILE.json",
        help="a file holding one JSON object of keyword arguments, sent every time",
    )
    requests.add_argument(
        "--input-len",
        type=_positive_int,
        default=128,
        metavar="WORDS",
        help="words per synthetic prompt (128)",
    )
    requests.add_argument(
        "--max-tokens",
        type=_positive_int,
        metavar="N",
        help="max_tokens of every request (synthetic ones: chat 128, agent 1024, batch "
        "256; those of --prompts or --body keep their own unless this is given)",
    )
    requests.add_argument(
        "--args",
        default="{}",
        metavar="JSON",
        help="keyword arguments added to every request; null drops one, "
        'e.g. \'{"prompt": null, "to": 8}\'',
    )
    output = parser.add_argument_group("report")
    output.add_argument(
        "--slo",
        metavar="METRIC=TIME,...",
        help="goodput objectives, e.g. ttft=500ms,itl=50ms,tpot=30ms,e2e=2s "
        "(itl bounds a request's longest gap)",
    )
    output.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even if some requests failed (default: exit 1)",
    )
    output.add_argument("--json", action="store_true", help="print the report as JSON")
    output.add_argument(
        "--json-requests",
        action="store_true",
        help="with the JSON report, include every request's record (implies --json)",
    )
    output.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw TTFT and E2E over time (matplotlib)"
    )
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class Bench:
    """Everything a run needs, checked before any request is sent."""

    target: Target
    plan: LoadPlan
    arguments: list[dict[str, Any]] | None
    extra: dict[str, Any]
    slos: Slos
    settings: dict[str, Any]
    accepts: Accepts | None  # what the method takes; None: unknown (a web app's route)
    max_tokens: int  # of synthetic requests


def run(args: argparse.Namespace) -> int:
    try:
        # Opened before the run, as `ember call -o` opens its file: a path that cannot be
        # written fails now, not after minutes of load (and a failed run leaves none).
        with output_file(args.plot) as plot:
            return _bench(args, plot)
    except EmberError as exc:
        print(f"ember bench: {exc}", file=sys.stderr)
        return SETUP_FAILED


def _bench(args: argparse.Namespace, plot: OutputFile | None) -> int:
    bench = prepare(args)
    _announce(bench)
    try:
        result, interrupted = asyncio.run(drive(bench, args))
    except FatalLoadError as exc:
        raise FatalLoadError(_explained(exc, bench.target)) from None
    duration = result.finished_at - result.started_at
    report = build_report(
        result.records,
        duration=duration,
        slos=bench.slos,
        interrupted=result.interrupted,
        first_errors=result.first_errors,
        settings=bench.settings,
    )
    cost = run_cost(bench.target.label, duration, report["output_tokens"])
    if cost is not None:
        report["cost"] = cost
    if args.json or args.json_requests:
        if args.json_requests:
            report["records"] = [r.to_dict(result.started_at) for r in result.records]
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    if plot is not None:
        plot.write(plot_latencies(result.records, result.started_at))
        print(f"ember bench: latency plot written to {plot.path}", file=sys.stderr)
    if interrupted:
        return INTERRUPTED
    counts = report["requests"]
    if counts["failed"] and not args.allow_failures:
        first = report["first_errors"][0] if report["first_errors"] else "no error message"
        print(
            f"ember bench: {counts['failed']} of {counts['finished']} requests failed "
            f"(first: {first}); exit status 1 (--allow-failures: 0)",
            file=sys.stderr,
        )
        return REQUESTS_FAILED
    return 0


def run_cost(label: str, seconds: float, output_tokens: int) -> dict[str, Any] | None:
    """What the endpoint's replicas cost over the run at the server's prices
    (`ember server --price`), and per million output tokens; None where the server sets
    no prices or this token may not read usage."""
    named = split_label(label)
    if named is None:
        return None
    app = split_app_key(named[0])[1]
    params = {"app": app, "since": str(max(1, math.ceil(seconds)))}
    try:
        with admin_client() as client:
            answer = client.get("/v1/usage", params=params)
    except (httpx.HTTPError, EmberError):
        return None
    if answer.status_code != 200 or not answer.json().get("prices"):
        return None
    row = next((r for r in answer.json()["endpoints"] if r["endpoint"] == named[1]), None)
    if row is None:
        return None
    cost = float(row["cost"])
    per_million = cost / output_tokens * 1e6 if output_tokens else None
    return {"cost": cost, "per_million_output_tokens": per_million}


def _explained(exc: FatalLoadError, target: Target) -> str:
    """A web app's 404 or 405: most likely no route there takes a POST; say how to name one."""
    if not target.web_app or exc.status not in (404, 405):
        return str(exc)
    return (
        f"{exc} ({target.label} is a web app and bench POSTs to {target.url}: name the path "
        f"of a route that takes a POST, as in {target.label}/v1/chat/completions)"
    )


def prepare(args: argparse.Namespace) -> Bench:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise InvalidError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'ember[bench]')"
        )
    plan = _plan(args)
    extra = parse_arguments(args.args, "--args")
    arguments = _given_requests(args)
    slos = parse_slos(args.slo) if args.slo else Slos()
    config = load_config()
    target = check_target(parse_target(args.target, config), config)
    if target.stream_flag is not None:
        # A method that streams when asked (OpenAI's "stream"): asked, unless --args says.
        extra = {target.stream_flag: True, **extra}
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS[args.workload]
    where = target.label + (f"/{target.method}" if target.method else "")
    accepts = accepts_of(where, target.spec, target.method)
    if args.max_tokens is not None and arguments is not None:
        name = accepts.max_tokens_name if accepts is not None else MAX_TOKENS_NAMES[0]
        if accepts is not None and name is None:
            raise InvalidError(f"--max-tokens: {where} has no max_tokens ({accepts.describe()})")
        arguments = [
            with_max_tokens(request, name or MAX_TOKENS_NAMES[0], args.max_tokens)
            for request in arguments
        ]
    _check_fit(args, accepts, arguments, extra, max_tokens)
    settings = {
        "url": target.url,
        "workload": args.workload,
        "rate": plan.rate,
        "concurrency": plan.concurrency,
        "num_requests": plan.num_requests,
        "duration": plan.duration,
        "seed": plan.seed,
        "prompts": str(args.prompts) if args.prompts else None,
        "input_len": None if args.prompts else args.input_len,
        "max_tokens": args.max_tokens if arguments is not None else max_tokens,
        "body": args.body is not None or args.body_file is not None,
        "args": extra,
    }
    return Bench(target, plan, arguments, extra, slos, settings, accepts, max_tokens)


def _given_requests(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The requests --prompts, --body or --body-file give; None: synthetic ones."""
    if args.prompts:
        return load_prompt_file(args.prompts)
    if args.body is not None:
        return [parse_arguments(args.body, "--body")]
    if args.body_file is not None:
        return [parse_arguments(read_text_file(args.body_file, "--body-file"), "--body-file")]
    return None


def _check_fit(
    args: argparse.Namespace,
    accepts: Accepts | None,
    arguments: list[dict[str, Any]] | None,
    extra: dict[str, Any],
    max_tokens: int,
) -> None:
    """Refuse, before anything is sent, requests the method cannot take."""
    if accepts is None:
        return
    if arguments is None:
        if args.max_tokens is not None and accepts.max_tokens_name is None:
            raise InvalidError(
                f"--max-tokens: {accepts.where} has no max_tokens ({accepts.describe()})"
            )
        sample = argument_stream(
            prompts=None,
            input_len=args.input_len,
            max_tokens=max_tokens,
            extra=extra,
            seed=0,
            accepts=accepts,
        )
        how = (
            f"give it requests with --body '{example_body(accepts)}' (or --body-file "
            "FILE.json, --prompts FILE.jsonl; --args adds arguments and drops those it "
            "sets to null)"
        )
        check_requests(accepts, [next(sample)], "the synthetic load", how)
        return
    source = "--prompts" if args.prompts else "--body" if args.body is not None else "--body-file"
    merged = [merge_arguments(request, extra) for request in arguments]
    how = "fix the request (--args drops an argument it sets to null)"
    check_requests(accepts, merged, f"{source}'s request", how)


def _plan(args: argparse.Namespace) -> LoadPlan:
    rate, concurrency = args.rate, args.concurrency
    if args.workload == "batch":
        if rate is not None:
            raise InvalidError("--rate does not apply to --workload batch (it never paces)")
        concurrency = concurrency or DEFAULT_BATCH_CONCURRENCY
    elif args.workload == "chat":
        rate = rate or DEFAULT_CHAT_RATE
    elif rate is None:  # agent: a fixed number of agents unless arrivals are paced
        concurrency = concurrency or DEFAULT_AGENT_CONCURRENCY
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    return LoadPlan(rate, concurrency, num_requests, args.duration, args.seed)


def _announce(bench: Bench) -> None:
    plan = bench.plan
    pace = f"Poisson arrivals at {plan.rate:g}/s" if plan.rate else "no pacing"
    if plan.concurrency:
        pace += f", at most {plan.concurrency} in flight"
    if plan.num_requests:
        amount = f"{plan.num_requests} request{'s' if plan.num_requests > 1 else ''}"
    else:
        amount = f"{plan.duration:g} s"
    print(
        f"ember bench: {bench.settings['workload']} load on {bench.target.url}: {amount}, {pace}",
        file=sys.stderr,
    )
    if bench.target.streaming is False:
        print(
            "ember bench: this method does not stream; each answer counts as one token "
            "(TTFT = E2E)",
            file=sys.stderr,
        )


async def drive(bench: Bench, args: argparse.Namespace) -> tuple[LoadResult, bool]:
    """Run the load; the first Ctrl+C stops it (in-flight requests are cancelled)."""
    config = load_config()
    interrupt = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print("\nember bench: stopping (Ctrl+C again to quit at once)", file=sys.stderr)
        interrupt.set()
        loop.remove_signal_handler(signal.SIGINT)

    with contextlib.suppress(NotImplementedError):  # no loop signal handlers on Windows
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    pool = bench.plan.concurrency  # None: as many connections as requests in flight
    arguments = argument_stream(
        prompts=bench.arguments,
        input_len=args.input_len,
        max_tokens=bench.max_tokens,
        extra=bench.extra,
        seed=bench.plan.seed,
        accepts=bench.accepts,
    )
    progress = Progress(bench.plan.num_requests, "bench")
    try:
        async with httpx.AsyncClient(
            verify=client_context(config.ca_cert),
            headers={"Authorization": f"Bearer {config.token}"},
            timeout=httpx.Timeout(args.timeout, connect=10.0, pool=None),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
        ) as client:
            result = await run_load(
                client,
                bench.target.url,
                arguments,
                bench.plan,
                interrupt,
                lambda record: progress.update(record.ok),
            )
    finally:
        progress.close()
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(signal.SIGINT)
    return result, interrupt.is_set()
