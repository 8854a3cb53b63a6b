"""Gangs: a replica over two nodes, started cold and restored from its ranks' snapshots,
and its tokens/s against one rank.

examples/llm/tensor_parallel.py (SmolLM2-135M split over the ranks of a gang, gloo
between them) runs on two `ember worker` nodes of one `ember server --no-worker` on this
machine, as app `tp` (2 ranks), beside the same file deployed with one rank as app `one`
(an ordinary replica: no gang, no all-reduce). Each round scales both to zero, calls `tp`
once so that a gang starts (the first round cold, taking each rank's snapshot; the later
ones restored from them), then times greedy decoding on `tp` and on `one`.

Reported: the gang's start (placement to rank 0 ready: every member started and its
process group formed) cold and restored, their ratio (reach: restore <= 15 % of cold),
each path's time to the first answer, and decode tokens/s of two ranks and of one, with
their ratio. Every answer must carry the same token ids.

    .venv/bin/python bench/gang.py           # 5 rounds, 32 tokens: about 2 minutes
    .venv/bin/python bench/gang.py --quick   # 2 rounds (cold, restore), 8 tokens
    .venv/bin/python bench/gang.py --json    # machine-readable

The model is converted once into --model-dir (examples/llm/convert.py; default: a folder
in the run's scratch space). A run that fails part-way prints what it measured before,
and which part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from procs import (
    Parts,
    ServerProcess,
    fill_defaults,
    isolated_env,
    progress,
    server_url,
    stopped_at_exit,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llm"
REACH_RESTORE_RATIO = 0.15
ENDPOINT = "tensor-parallel"
NODES = ("node-a", "node-b")
CALL_TIMEOUT_S = 600.0
QUESTION = "What is the capital of France?"


def ember_cli(env: dict[str, str], *args: str, timeout: float = 300.0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ember.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"ember {' '.join(args)}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def members(env: dict[str, str], app: str) -> list[dict[str, Any]]:
    rows = json.loads(ember_cli(env, "replica", "ls", app, "--json"))
    return sorted((r for r in rows if r["endpoint"] == ENDPOINT), key=lambda r: r["rank"])


def wait_until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


def platform_state(config: Any) -> dict[str, Any]:
    """The platform's picture (`/v1/apps`): endpoints and workers."""
    import httpx

    from ember.calling.tlsclient import client_context

    headers = {"Authorization": f"Bearer {config.token}"}
    verify = client_context(config.ca_cert)
    with httpx.Client(base_url=config.server_url, verify=verify, headers=headers) as client:
        state: dict[str, Any] = client.get("/v1/apps", timeout=30).json()
        return state


def images(config: Any) -> int:
    """The gang endpoint's snapshot images published."""
    rows = platform_state(config)["endpoints"]
    (row,) = [e for e in rows if e["label"] == f"tp--{ENDPOINT}"]
    return len(row["snapshots"])


def start_platform(
    work: Path, model_dir: Path, started: list[ServerProcess], quiet: bool
) -> tuple[dict[str, str], Any]:
    """`ember server --no-worker` and two workers that show the model to their replicas;
    the CLI's environment, and the admin's ClientConfig."""
    from ember.config import ClientConfig

    env = isolated_env(work, EMBER_LLM_DIR=str(model_dir))
    state = work / "state"
    command = [sys.executable, "-m", "ember.cli.main", "server", "--no-worker"]
    server = ServerProcess.start(
        "ember server", [*command, "--state-dir", str(state), "--port", "0"], work / "cp.log", env
    )
    started.append(server)
    url = server_url(server, 120.0)
    config = ClientConfig(
        server_url=url,
        token=(state / "admin-token").read_text().strip(),
        ca_cert=str(state / "ca.pem"),
    )
    token = ember_cli(env, "token", "create", "--scope", "worker").strip()
    for node in NODES:
        worker = [
            sys.executable,
            *("-m", "ember.cli.main", "worker", "--server", url, "--token", token),
            *("--ca-cert", str(state / "ca.pem"), "--name", node),
            *("--work-dir", str(work / node), "--model-dir", str(model_dir)),
            *("--replica-env", "EMBER_LLM_DIR"),
        ]
        started.append(ServerProcess.start(node, worker, work / f"{node}.log", env))
    wait_until(lambda: len(platform_state(config)["workers"]) == 2, 60, "two workers joined")
    progress(quiet, f"platform up at {url} with workers {', '.join(NODES)}")
    return env, config


def generate(config: Any, app: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    import ember

    endpoint = ember.Endpoint.lookup(app, ENDPOINT, config=config)
    started = time.monotonic()
    answer: dict[str, Any] = endpoint.generate.call(prompt_ids=prompt, max_new_tokens=tokens)
    answer["answered_seconds"] = time.monotonic() - started
    return answer


HOST_LOOPBACK = ("local", "127.0.0.1", "dev", "lo", "table", "local", "proto", "kernel")
HOST_LOOPBACK_REST = ("scope", "host", "src", "127.0.0.1")


@contextlib.contextmanager
def quick_host_loopback(wanted: bool, figures: dict[str, Any]) -> Iterator[None]:
    """The node's route to 127.0.0.1 with quick ACKs while the run lasts (put back as it
    was after): two nodes on one machine reach each other's gang members through pasta
    and the node's loopback, where pasta's sockets (no TCP_NODELAY) would wait out a
    delayed ACK after each small write (docs/scaling.md)."""
    figures["host_loopback_quickack"] = False
    if not wanted or os.geteuid() != 0:
        yield
        return
    ip = ["ip", "route", "replace", *HOST_LOOPBACK, *HOST_LOOPBACK_REST]
    subprocess.run([*ip, "quickack", "1"], check=True, capture_output=True)
    figures["host_loopback_quickack"] = True
    try:
        yield
    finally:
        subprocess.run(ip, check=True, capture_output=True)


def run(args: argparse.Namespace, figures: dict[str, Any], parts: Parts) -> None:
    work = Path(tempfile.mkdtemp(prefix="ember-gang-bench-"))
    try:
        _run(args, work, figures, parts)
    finally:  # its platform's state: gigabytes of environments and images
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path, figures: dict[str, Any], parts: Parts) -> None:
    model_dir = args.model_dir or work / "smollm2"
    parts.now = "converting the model"
    subprocess.run(
        [sys.executable, str(EXAMPLE / "convert.py"), "--out", str(model_dir)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    model_dir.chmod(0o755)  # every workspace's replicas read it
    sys.path.insert(0, str(EXAMPLE))
    from model import chat_prompt_ids

    prompt = chat_prompt_ids(model_dir, [{"role": "user", "content": QUESTION}])
    with quick_host_loopback(not args.leave_host_route, figures), stopped_at_exit() as started:
        parts.now = "starting the platform"
        env, config = start_platform(work, model_dir, started, args.quiet)
        parts.now = "deploying"
        app_file = str(EXAMPLE / "tensor_parallel.py")
        ember_cli(env, "deploy", app_file, "--name", "tp")
        ember_cli({**env, "EMBER_TP_NODES": "1"}, "deploy", app_file, "--name", "one")
        figures.update(rounds=[], tokens=args.tokens)
        for round_index in range(args.rounds):
            kind = "cold" if round_index == 0 else "restore"
            parts.now = f"round {round_index + 1} ({kind} gang)"
            for app in ("tp", "one"):  # from zero: the next call starts a new gang
                if rows := members(env, app):  # rank 0's end ends its gang
                    ember_cli(env, "replica", "stop", "--now", rows[0]["id"])
            wait_until(lambda: not members(env, "tp"), 120, "the gang gone")
            first = generate(config, "tp", prompt, args.tokens)
            gang = members(env, "tp")
            kinds = [row["start_kind"] for row in gang]
            if kinds != [kind] * len(NODES):
                raise RuntimeError(f"the gang's members started {kinds}, not {kind}")
            timed = generate(config, "tp", prompt, args.tokens)
            alone = generate(config, "one", prompt, args.tokens)
            ids = {tuple(a["token_ids"]) for a in (first, timed, alone)}
            if len(ids) != 1:
                raise RuntimeError(f"the answers' token ids differ: {sorted(ids)}")
            figures["rounds"].append(
                {
                    "kind": kind,
                    "gang_start_seconds": gang[0]["start_seconds"],
                    "first_answer_seconds": round(first["answered_seconds"], 3),
                    "two_ranks_tokens_per_second": len(timed["token_ids"]) / timed["seconds"],
                    "one_rank_tokens_per_second": len(alone["token_ids"]) / alone["seconds"],
                }
            )
            progress(args.quiet, f"round {round_index + 1}: {figures['rounds'][-1]}")
            if kind == "cold":
                parts.now = "waiting for the ranks' snapshots"
                wait_until(lambda: images(config) == len(NODES), 300, "both ranks' images")
    summarize(figures)


def summarize(figures: dict[str, Any]) -> None:
    rounds = figures["rounds"]
    by_kind = {
        kind: [r["gang_start_seconds"] for r in rounds if r["kind"] == kind]
        for kind in ("cold", "restore")
    }
    if not by_kind["cold"] or not by_kind["restore"]:
        return
    cold, restore = statistics.median(by_kind["cold"]), statistics.median(by_kind["restore"])
    two = statistics.median(r["two_ranks_tokens_per_second"] for r in rounds)
    one = statistics.median(r["one_rank_tokens_per_second"] for r in rounds)
    figures["summary"] = {
        "gang_cold_start_seconds": cold,
        "gang_restore_seconds": restore,
        "restore_over_cold": restore / cold,
        "two_ranks_tokens_per_second": two,
        "one_rank_tokens_per_second": one,
        "two_ranks_over_one": two / one,
    }
    figures["verdicts"] = {"restore <= 15% of cold": restore / cold <= REACH_RESTORE_RATIO}


def report(figures: dict[str, Any]) -> str:
    lines = [f"gang of {len(NODES)} ranks (examples/llm/tensor_parallel.py), this machine"]
    quick = "on" if figures.get("host_loopback_quickack") else "off"
    lines.append(f"  quick ACKs on the node's route to 127.0.0.1 for the run: {quick}")
    for index, r in enumerate(figures.get("rounds", []), 1):
        lines.append(
            f"  round {index} ({r['kind']}): gang start {r['gang_start_seconds']:.2f} s, "
            f"first answer {r['first_answer_seconds']:.2f} s, decode "
            f"{r['two_ranks_tokens_per_second']:.1f} tok/s (2 ranks) vs "
            f"{r['one_rank_tokens_per_second']:.1f} tok/s (1 rank)"
        )
    summary = figures.get("summary")
    if summary:
        verdict = "PASS" if figures["verdicts"]["restore <= 15% of cold"] else "MISS"
        lines += [
            "",
            "| | 2 ranks (gang) | 1 rank | ratio | verdict |",
            "|---|---|---|---|---|",
            f"| start, cold | {summary['gang_cold_start_seconds']:.2f} s | | | |",
            f"| start, restored | {summary['gang_restore_seconds']:.2f} s | | "
            f"{summary['restore_over_cold']:.1%} of cold | {verdict} (reach <= 15 %) |",
            f"| decode tokens/s | {summary['two_ranks_tokens_per_second']:.1f} | "
            f"{summary['one_rank_tokens_per_second']:.1f} | "
            f"{summary['two_ranks_over_one']:.2f}x | (no reach) |",
        ]
    if figures.get("failed"):
        lines.append(f"FAILED: {figures['failed']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="a cold gang, then restored ones (5)")
    parser.add_argument("--tokens", type=int, help="greedy tokens per timed call (32)")
    parser.add_argument("--model-dir", type=Path, help="the converted model (made if absent)")
    parser.add_argument(
        "--leave-host-route",
        action="store_true",
        help="run without quick ACKs on this node's route to 127.0.0.1 (set by default, "
        "as root, and put back after)",
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 tokens")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    return fill_defaults(args, {"rounds": (5, 2), "tokens": (32, 8)})


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    parts = Parts("bench/gang.py")
    figures: dict[str, Any] = {}
    failed: BaseException | None = None
    try:
        run(args, figures, parts)
    except KeyboardInterrupt:
        print("interrupted; the platform and its processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the parts before measured is shown all the same
        failed = error
    if parts.show(figures, failed, args.json, report):
        return 2
    if args.quick:  # two rounds: the verdict is printed, not judged
        return 0
    return 0 if all(figures.get("verdicts", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
