"""The LLM example (examples/llm: SmolLM2-135M-Instruct on CPU) against its baselines.

Four parts, run one after another in one process on one machine, each side by side with
its baseline:

1. batching: concurrent chat requests through the continuous-batching `Engine` (all
   submitted at once) vs Hugging Face transformers' `generate` one request at a time, and
   our own `model.generate` one at a time; output tokens/s, and whether the greedy tokens
   agree. Reach: Engine >= 3x transformers.
2. lookup: prompt-lookup speculative decoding vs plain greedy decoding, batch 1, on a
   spelling fix whose answer copies its input; tokens/s (best of 3), acceptance rate,
   forward passes, identical tokens; in the engine (drafts verified in its batched step,
   what the endpoint runs) and by the standalone `prompt_lookup.py`. Reach: the engine's
   >= 1.5x, and the tokens identical.
3. int8: int8 weights vs fp32 (examples/llm/evaluate_int8.py): decode tokens/s at batch
   1, perplexity, greedy agreement. No reach: figures only.
4. platform: `ember bench` at the deployed example (a real `ember server` in a temporary
   state dir), pinned to one replica (`ember scale --min 1 --max 1`), vs the same prompts
   at the same Poisson arrival times submitted to one Engine in this process: the TTFT
   the platform adds at P50 and P99. No reach.

    .venv/bin/python bench/llm.py                     # about 6 minutes on 2 CPUs
    .venv/bin/python bench/llm.py --parts batching,lookup
    .venv/bin/python bench/llm.py --json              # machine-readable
    .venv/bin/python bench/llm.py --quick             # every part, small: 1-2 minutes

--quick runs every part at its smallest: 2 requests of 8 new tokens, one round, one
attempt each way in part 2, 1 prompt x 8 tokens of agreement and 2 paragraphs of
perplexity in part 3, and in part 4 6 requests of 4 tokens at 3/s with the decode step
eager on both sides (EMBER_LLM_COMPILE=0) and the platform's snapshots off
(EMBER_LLM_SNAPSHOT=0): compiling and packing an image would take minutes. A part that
fails is reported beside what the others measured (N. part: FAILED: why), and the run
exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from procs import ServerProcess, isolated_env, progress, server_url, stopped_at_exit

T = TypeVar("T")

REACH_BATCHING = 3.0
REACH_LOOKUP = 1.5
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm"
DEFAULT_DIR = Path.home() / ".cache" / "ember" / "llm" / "smollm2"
PARTS = ("batching", "lookup", "int8", "platform")
APP = "llm"
TARGET = f"{APP}--llm/generate"
BOOT_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 300.0  # the first call boots a replica: load, warm, snapshot
SNAPSHOT_TIMEOUT_S = 180.0
WARM_CALLS = 2  # calls before `ember bench`; the in-process side gets as many

# Open questions with long answers, so few end their turn within the tokens compared.
QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright while it moves.",
    "Describe a busy market on a Saturday morning.",
    "Give me five tips for learning a new language, with a sentence on each.",
    "What does a KV cache store in a transformer decoder, and why does it help?",
    "Write a letter to a friend about a trip to the mountains.",
    "What are the main differences between a cat and a dog as pets?",
    "Describe how bread is made, step by step.",
]

GROUNDED = (
    "Rewrite this text, fixing the spelling: The quick brown fox jumpd over the lazy dog. "
    "Every morning the farmer walkd to the feild to feed his cows and check on the shep. "
    "In the afternon he repaired the fence and watered the vegetable garden before diner."
)


def timed(work: Callable[[], T]) -> tuple[T, float]:
    began = time.perf_counter()
    result = work()
    return result, time.perf_counter() - began


# ===================================================================================
# Part 1: continuous batching vs transformers one request at a time.
# ===================================================================================


def load_transformers(directory: Path) -> Any:
    """LlamaForCausalLM from the converted folder, offline; every weight must load (a
    missing one would be left random and the comparison meaningless)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = LlamaConfig.from_pretrained(directory, local_files_only=True)
    config.use_cache = True
    model, info = AutoModelForCausalLM.from_pretrained(
        directory,
        config=config,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation="sdpa",  # the kernel model.py uses
        output_loading_info=True,
    )
    # The output head is tied to the embedding, so it is not in the file.
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    if missing or info["unexpected_keys"]:
        raise RuntimeError(
            f"transformers could not load {directory}: missing {missing}, "
            f"unexpected {info['unexpected_keys']}"
        )
    return model.eval()


def hf_generate(model: Any, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # no early stop: the same work as ours
            pad_token_id=eos,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def agreement(ours: list[list[int]], theirs: list[list[int]], eos: int) -> dict[str, float]:
    """Positions before the first divergence, each answer compared up to our end-of-turn:
    `min_new_tokens` keeps transformers from ending it, so what follows is not comparable."""
    agreed = compared = full = 0
    for mine, other in zip(ours, theirs, strict=True):
        span = mine.index(eos) if eos in mine else len(mine)
        prefix = next((i for i in range(span) if mine[i] != other[i]), span)
        agreed, compared, full = agreed + prefix, compared + span, full + (prefix == span)
    return {"share": agreed / compared if compared else 1.0, "identical": full}


def batching_paths(
    model: Any, hf: Any, engine: Any, prompts: list[list[int]], new_tokens: int, eos: int
) -> dict[str, Callable[[], list[list[int]]]]:
    """Each path of part 1: every prompt's tokens, the one-at-a-time ones in turn."""
    return {
        "transformers": lambda: [hf_generate(hf, p, new_tokens, eos) for p in prompts],
        "model_generate": lambda: [list(model.generate(p, new_tokens)) for p in prompts],
        "engine": lambda: engine.generate_many(prompts, new_tokens),
    }


def measure_batching(
    model: Any, directory: Path, prompts: list[list[int]], new_tokens: int, eos: int, rounds: int
) -> dict[str, Any]:
    """Best of `rounds` per path, the order reversed every other round, so that a
    neighbour's load on the machine does not land on one path only."""
    from engine import Engine

    progress_line("part 1: loading transformers' LlamaForCausalLM from the converted folder ...")
    hf = load_transformers(directory)
    longest = max(map(len, prompts)) + new_tokens
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    out: dict[str, list[list[int]]] = {}
    # No prefix cache: the chat template's shared start would spare the Engine some
    # prefill, and this part measures batching alone.
    with Engine(model, max_batch=len(prompts), max_len=longest, prefix_cache_bytes=0) as engine:
        paths = batching_paths(model, hf, engine, prompts, new_tokens, eos)
        hf_generate(hf, prompts[0], 2, eos)  # warm each path before timing it
        list(model.generate(prompts[0], 2))
        engine.generate_many(prompts[:1], 2)
        for number in range(rounds):
            for name in list(paths)[:: 1 if number % 2 == 0 else -1]:
                progress_line(f"part 1, round {number + 1}/{rounds}: {name} ...")
                began_cpu = time.process_time()
                out[name], took = timed(paths[name])
                if took < seconds.get(name, float("inf")):
                    seconds[name] = took
                    cpu[name] = (time.process_time() - began_cpu) / took
        del paths, hf  # half a GB the other parts do not need
    gc.collect()
    batched, theirs, alone = out["engine"], out["transformers"], out["model_generate"]
    return {
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "prompt_tokens": [len(p) for p in prompts],
        "seconds": seconds,
        # CPU seconds per second of the best run: below the thread count, it waited for
        # the CPUs (another process on the machine), not for itself.
        "cpu_per_s": cpu,
        "tokens_per_s": {name: sum(map(len, out[name])) / seconds[name] for name in out},
        "speedup_vs_transformers": seconds["transformers"] / seconds["engine"],
        "speedup_vs_model_generate": seconds["model_generate"] / seconds["engine"],
        "agreement_vs_transformers": agreement(batched, theirs, eos),
        "engine_equals_model_generate": sum(a == b for a, b in zip(batched, alone, strict=True)),
    }


# ===================================================================================
# Part 2: prompt-lookup speculative decoding vs plain decoding.
# ===================================================================================


def lookup_once(
    model: Any, prompt: list[int], new_tokens: int, *, ngram: int, draft_len: int
) -> tuple[list[int], Any]:
    from prompt_lookup import LookupStats, generate_prompt_lookup

    stats = LookupStats()
    tokens = list(
        generate_prompt_lookup(
            model, prompt, new_tokens, ngram=ngram, draft_len=draft_len, stats=stats
        )
    )
    return tokens, stats


def measure_lookup(
    model: Any,
    prompt: list[int],
    new_tokens: int,
    *,
    attempts: int,
    ngram: int = 3,
    draft_len: int = 8,
) -> dict[str, Any]:
    """Best of `attempts` each way, alternating, after a warm-up; no stop ids, so both
    produce exactly `new_tokens`."""
    from engine import Engine
    from prompt_lookup import LookupStats

    for _ in model.generate(prompt, 2):
        pass
    plain_s = lookup_s = float("inf")
    plain: list[int] = []
    looked: list[int] = []
    stats = LookupStats()
    engines = {
        drafts: Engine(
            model,
            max_batch=1,
            max_len=len(prompt) + new_tokens,
            prefix_cache_bytes=0,
            draft_len=drafts,
            ngram=ngram,
        )
        for drafts in (0, draft_len)
    }
    engine_s = dict.fromkeys(engines, float("inf"))
    engine_out: dict[int, list[int]] = {}
    try:
        for engine in engines.values():
            engine.generate_many([prompt], 2)  # warm
        for attempt in range(attempts):
            progress_line(
                f"part 2: plain and prompt-lookup decoding, attempt {attempt + 1}/{attempts} ..."
            )
            plain, seconds = timed(lambda: list(model.generate(prompt, new_tokens)))
            plain_s = min(plain_s, seconds)
            (looked, stats), seconds = timed(
                partial(lookup_once, model, prompt, new_tokens, ngram=ngram, draft_len=draft_len)
            )
            lookup_s = min(lookup_s, seconds)
            for drafts, engine in engines.items():
                engine_out[drafts], seconds = timed(
                    lambda engine=engine: engine.submit(prompt, new_tokens).result()
                )
                engine_s[drafts] = min(engine_s[drafts], seconds)
        in_engine = engines[draft_len].lookup_stats()
    finally:
        for engine in engines.values():
            engine.close()
    return {
        # The endpoint's path: drafts verified inside the engine's batched step.
        "engine_plain_tokens_per_s": len(engine_out[0]) / engine_s[0],
        "engine_lookup_tokens_per_s": len(engine_out[draft_len]) / engine_s[draft_len],
        "engine_speedup": engine_s[0] / engine_s[draft_len],
        "engine_acceptance_rate": in_engine["acceptance_rate"],
        "engine_tokens_per_step": in_engine["tokens_per_step"],
        "engine_identical": engine_out[0] == engine_out[draft_len] == plain,
        # The standalone function (prompt_lookup.py), one sequence through the model's own
        # cache.
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "attempts": attempts,
        "ngram": ngram,
        "draft_len": draft_len,
        "plain_tokens_per_s": len(plain) / plain_s,
        "lookup_tokens_per_s": len(looked) / lookup_s,
        "speedup": plain_s / lookup_s,
        "acceptance_rate": stats.acceptance_rate,
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "forward_passes": stats.forward_passes,
        "plain_forward_passes": len(plain),
        "identical": plain == looked,
    }


# ===================================================================================
# Part 3: int8 vs fp32, through evaluate_int8.py.
# ===================================================================================


def measure_int8(
    model: Any,
    directory: Path,
    new_tokens: int,
    *,
    prompts: int,
    agree_tokens: int,
    paragraphs: int | None,
) -> dict[str, Any]:
    """evaluate_int8.py's measures: greedy agreement over its first `prompts` questions x
    `agree_tokens` tokens, perplexity on its first `paragraphs` (None: all), decode
    tokens/s."""
    from evaluate_int8 import PARAGRAPHS, evaluate
    from evaluate_int8 import QUESTIONS as EVAL_QUESTIONS
    from model import chat_prompt_ids, load_model, tokenizer
    from quantize import projection_bytes, quantize_int8

    progress_line("part 3: quantizing a second copy to int8 ...")
    int8 = quantize_int8(load_model(directory))
    chats = [
        chat_prompt_ids(directory, [{"role": "user", "content": q}])
        for q in EVAL_QUESTIONS[:prompts]
    ]
    texts = [tokenizer(directory).encode(p).ids for p in PARAGRAPHS[:paragraphs]]
    progress_line("part 3: greedy agreement, perplexity, decode tokens/s ...")
    result: dict[str, Any] = evaluate(
        model, int8, chats, texts, agree_tokens=agree_tokens, new_tokens=new_tokens
    )
    result.update(
        agree_tokens=agree_tokens,
        paragraphs=len(texts),
        new_tokens=new_tokens,
        projection_mib_fp32=projection_bytes(model) / 2**20,
        projection_mib_int8=projection_bytes(int8) / 2**20,
    )
    return result


# ===================================================================================
# Part 4: TTFT through the platform vs the Engine in this process.
# ===================================================================================


def ember(env: dict[str, str], *args: str, timeout: float = 120.0) -> str:
    """Run the `ember` CLI; its stdout, or an error with its stderr."""
    command = [sys.executable, "-m", "ember.cli.main", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ember {args[0]} exited with {done.returncode}:\n{done.stderr}")
    return done.stdout


def api_get(url: str, token: str, ca: Path, path: str) -> Any:
    context = ssl.create_default_context(cafile=str(ca))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    with opener.open(request, timeout=30) as response:
        return json.load(response)


def wait_for_snapshot(apps: Callable[[], Any], server: ServerProcess) -> str:
    """Wait until the replica's snapshot is published (packed and uploaded in the
    background, which would compete with the measured calls for the CPUs)."""
    deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
    while True:
        server.remember()
        status = apps()
        problems = [w["snapshots"].get("problem") for w in status["workers"]]
        if any(problems):
            return f"snapshots off: {next(p for p in problems if p)}"
        row = next(r for r in status["endpoints"] if r["app"] == APP)
        if row["snapshots"]:
            return f"snapshot published ({row['snapshots'][0]['size'] / 1e6:.0f} MB)"
        if time.monotonic() > deadline:
            return f"no snapshot after {SNAPSHOT_TIMEOUT_S:g} s ({row.get('snapshot_note')})"
        time.sleep(0.5)


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times from the start, as `ember bench` schedules them: the first at once, then
    one gap of `poisson_gaps(rate, seed)` before each of the others."""
    from ember.loadgen.arrivals import poisson_gaps

    gaps = poisson_gaps(rate, seed)
    offsets = [0.0]
    for _ in range(count - 1):
        offsets.append(offsets[-1] + next(gaps))
    return offsets


def platform_side(args: argparse.Namespace, work: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Start a server, deploy the example, warm it, and run `ember bench` at it."""
    state = work / "state"
    # Replicas find the converted model by EMBER_LLM_DIR, in a folder the server shows them
    # (--model-dir): a sandboxed replica sees nothing else of the node's. --quick keeps
    # their decode step eager, as the in-process side's (main sets it for this process).
    eager = {"EMBER_LLM_COMPILE": "0"} if args.quick else {}
    env = isolated_env(work, EMBER_LLM_DIR=str(args.dir.resolve()), **eager)
    if args.quick:
        env["EMBER_LLM_SNAPSHOT"] = "0"  # read by `ember deploy`: no image to pack
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text(
        "".join(
            json.dumps({"prompt_ids": p, "max_new_tokens": args.platform_tokens}) + "\n"
            for p in prompts
        )
    )
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    progress_line("part 4: starting ember server ...")
    with stopped_at_exit() as started:
        server = ServerProcess.start(
            "ember server",
            [*command, "--port", "0", "--model-dir", str(args.dir.resolve())],
            work / "server.log",
            env,
        )
        started.append(server)
        url = server_url(server, BOOT_TIMEOUT_S)
        token = (state / "admin-token").read_text().strip()

        def apps() -> Any:
            return api_get(url, token, state / "ca.pem", "/v1/apps")

        ember(env, "deploy", str(EXAMPLE / "app.py"), "--name", APP)
        # One replica, as the in-process side is one engine: a second one would halve
        # the platform side's load per engine and the comparison would not be like with like.
        ember(env, "scale", f"{APP}--llm", "--min", "1", "--max", "1")
        warm = json.dumps({"prompt_ids": prompts[0], "max_new_tokens": args.platform_tokens})
        progress_line("part 4: first call (a replica boots and loads the model) ...")
        _, first_call_s = timed(
            lambda: ember(env, "call", TARGET, warm, "--stream", timeout=CALL_TIMEOUT_S)
        )
        snapshot = "snapshots off (--quick)" if args.quick else wait_for_snapshot(apps, server)
        progress_line(f"part 4: {snapshot}")
        for _ in range(WARM_CALLS - 1):  # also keeps the replica from scaling down
            ember(env, "call", TARGET, warm, "--stream", timeout=CALL_TIMEOUT_S)
        server.remember()
        progress_line(
            f"part 4: ember bench, {args.platform_requests} requests at {args.rate:g}/s ..."
        )
        bench = [
            "bench", TARGET, "--workload", "chat", "--rate", str(args.rate),
            "--num-requests", str(args.platform_requests), "--seed", str(args.seed),
            "--prompts", str(prompt_file), "--timeout", "120", "--json",
        ]  # fmt: skip
        budget = args.platform_requests / args.rate + 180
        report = json.loads(ember(env, *bench, timeout=budget))
        server.remember()
        row = next(r for r in apps()["endpoints"] if r["app"] == APP)
        if not report["requests"]["ok"]:
            raise RuntimeError(f"ember bench: no request succeeded: {report['first_errors']}")
        return {
            "first_call_s": first_call_s,
            "snapshot": snapshot,
            "replicas_after": row["replicas"],
            "bench": report,
            "server_log_tail": server.tail(10),
        }


def inprocess_side(
    model: Any, prompts: list[list[int]], new_tokens: int, offsets: list[float], eos: int, bos: int
) -> dict[str, Any]:
    """The same prompts, submitted at the same offsets to an Engine set up as the
    replica's; TTFT from submit to the first token."""
    # The replica's engine, built and warmed as its `load` does; app.py reads
    # EMBER_LLM_DIR, set by main.
    from app import build_engine

    from ember.loadgen.stats import summarize

    stops = {eos}
    times: list[tuple[float, float, int]] = [(0.0, 0.0, 0)] * len(offsets)
    errors: list[str] = []

    def collect(index: int, handle: Any, sent: float) -> None:
        first, count = 0.0, 0
        try:
            for _ in handle.tokens():
                count += 1
                first = first or time.perf_counter()
        except Exception as error:  # the engine closed under it (Ctrl+C) or failed a step
            errors.append(f"{type(error).__name__}: {error}")
            return
        times[index] = (first - sent, time.perf_counter() - sent, count)

    engine, _ = build_engine(model, bos)
    with engine:
        for _ in range(WARM_CALLS):  # as the platform side's warm-up calls
            engine.submit(prompts[0], new_tokens, stops).result()
        readers: list[threading.Thread] = []
        started = time.perf_counter()
        for index, offset in enumerate(offsets):
            time.sleep(max(0.0, started + offset - time.perf_counter()))
            sent = time.perf_counter()
            handle = engine.submit(prompts[index % len(prompts)], new_tokens, stops)
            reader = threading.Thread(target=collect, args=(index, handle, sent))
            reader.start()
            readers.append(reader)
        for reader in readers:
            reader.join()
    if errors:
        raise RuntimeError(f"in-process requests failed: {errors[:3]}")
    ttft = summarize([t[0] for t in times])
    e2e = summarize([t[1] for t in times])
    assert ttft is not None and e2e is not None
    return {
        "requests": len(times),
        "output_tokens": sum(t[2] for t in times),
        "latency_s": {"ttft": ttft.to_dict(), "e2e": e2e.to_dict()},
    }


def measure_platform(
    args: argparse.Namespace, model: Any, prompts: list[list[int]], eos: int, bos: int
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ember-llm-bench-"))
    try:
        platform = platform_side(args, work, prompts)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    # After the server is gone, so that both sides have the machine to themselves.
    progress_line("part 4: the same prompts and arrival times into an in-process Engine ...")
    offsets = arrival_offsets(args.platform_requests, args.rate, args.seed)
    local = inprocess_side(model, prompts, args.platform_tokens, offsets, eos, bos)
    remote = platform["bench"]["latency_s"]
    added = {q: remote["ttft"][q] - local["latency_s"]["ttft"][q] for q in ("p50", "p99")}
    return {
        "requests": args.platform_requests,
        "rate": args.rate,
        "seed": args.seed,
        "new_tokens": args.platform_tokens,
        "prompts": len(prompts),
        "platform": platform,
        "in_process": local,
        "ttft_added_s": added,
    }


# ===================================================================================
# The run, verdicts and the report.
# ===================================================================================


QUIET = False


def progress_line(message: str) -> None:
    progress(QUIET, message)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(EXAMPLE))  # the example's modules are siblings of app.py
    from convert import convert
    from model import chat_prompt_ids, load_model

    torch.set_num_threads(args.threads)  # one count for every path of every part
    with contextlib.redirect_stdout(sys.stderr):  # its lines must not mix with --json
        convert(args.dir)
    config = json.loads((args.dir / "config.json").read_text())
    eos, bos = int(config["eos_token_id"]), int(config["bos_token_id"])
    progress_line(f"loading the model from {args.dir} ...")
    model = load_model(args.dir)
    questions = (QUESTIONS * (args.requests // len(QUESTIONS) + 1))[: args.requests]
    chats = [chat_prompt_ids(args.dir, [{"role": "user", "content": q}]) for q in questions]
    result: dict[str, Any] = {
        "setup": {
            "model": "SmolLM2-135M-Instruct (fp32)",
            "parameters": sum(p.numel() for p in model.parameters()),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": len(os.sched_getaffinity(0)),
            "parts": args.parts,
        }
    }

    def batching() -> dict[str, Any]:
        import transformers

        result["setup"]["transformers"] = transformers.__version__
        return measure_batching(model, args.dir, chats, args.new_tokens, eos, args.rounds)

    def lookup() -> dict[str, Any]:
        grounded = chat_prompt_ids(args.dir, [{"role": "user", "content": GROUNDED}])
        return measure_lookup(model, grounded, args.new_tokens, attempts=args.lookup_attempts)

    def int8() -> dict[str, Any]:
        return measure_int8(
            model,
            args.dir,
            args.new_tokens,
            prompts=args.int8_prompts,
            agree_tokens=args.agree_tokens,
            paragraphs=args.int8_paragraphs,
        )

    def platform() -> dict[str, Any]:
        platform_chats = [
            chat_prompt_ids(args.dir, [{"role": "user", "content": q}]) for q in QUESTIONS
        ]
        return measure_platform(args, model, platform_chats, eos, bos)

    measures: dict[str, Callable[[], dict[str, Any]]] = {
        "batching": batching,
        "lookup": lookup,
        "int8": int8,
        "platform": platform,
    }
    for name in args.parts:
        try:
            result[name] = measures[name]()
        except Exception as exc:
            # What the other parts measured is printed all the same, and this says why.
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            gc.collect()  # what the part left behind (models, engines) before the next
    return result


def verdicts(result: dict[str, Any]) -> dict[str, bool]:
    found: dict[str, bool] = {}
    if "batching" in result:
        found["batching_pass"] = result["batching"]["speedup_vs_transformers"] >= REACH_BATCHING
    if "lookup" in result:
        part = result["lookup"]
        found["lookup_pass"] = part["engine_speedup"] >= REACH_LOOKUP
        found["lookup_identical_pass"] = part["identical"] and part["engine_identical"]
    for name in PARTS:
        if f"{name}_error" in result:
            found[f"{name}_ran_pass"] = False
    return found


def failed_parts(result: dict[str, Any]) -> list[str]:
    return [name for name in PARTS if f"{name}_error" in result]


def mark(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def report_batching(part: dict[str, Any]) -> list[str]:
    rate, seconds = part["tokens_per_s"], part["seconds"]
    agree = part["agreement_vs_transformers"]
    n, best = part["requests"], f"best of {part['rounds']} rounds"
    rows = (
        ("transformers generate, one at a time", "transformers"),
        ("model.generate, one at a time", "model_generate"),
        (f"Engine, all {n} at once", "engine"),
    )
    lines = [
        f"1. continuous batching: {n} chat requests x {part['new_tokens']} new tokens each "
        f"(no stop ids; prompts {min(part['prompt_tokens'])}-{max(part['prompt_tokens'])} "
        "tokens)",
        f"   {best:40}{'tokens/s':>10}{'seconds':>10}{'vs transformers':>17}{'CPU s/s':>9}",
    ]
    for title, key in rows:
        ratio = seconds["transformers"] / seconds[key]
        lines.append(
            f"   {title:40}{rate[key]:>10.1f}{seconds[key]:>10.2f}{ratio:>16.2f}x"
            f"{part['cpu_per_s'][key]:>9.2f}"
        )
    lines += [
        f"   greedy tokens, Engine vs transformers: {agree['share']:.1%} of positions agree "
        f"before the first divergence (up to each answer's end of turn), {agree['identical']}"
        f"/{n} answers identical; Engine vs model.generate: "
        f"{part['engine_equals_model_generate']}/{n} identical",
        f"   Engine vs model.generate one at a time: {part['speedup_vs_model_generate']:.2f}x",
    ]
    return lines


def report_lookup(part: dict[str, Any]) -> list[str]:
    return [
        f"2. prompt lookup: 1 request (spelling fix, {part['prompt_tokens']} prompt tokens) x "
        f"{part['new_tokens']} new tokens, best of {part['attempts']} (ngram {part['ngram']}, "
        f"draft up to {part['draft_len']})",
        f"   plain {part['plain_tokens_per_s']:.1f} tokens/s in {part['plain_forward_passes']} "
        f"forward passes; prompt lookup {part['lookup_tokens_per_s']:.1f} tokens/s in "
        f"{part['forward_passes']}: {part['speedup']:.2f}x",
        f"   acceptance {part['acceptance_rate']:.0%} ({part['accepted']}/{part['proposed']} "
        f"drafted tokens); identical tokens: {part['identical']}",
        f"   in the engine (the endpoint's path, drafts verified in its batched step): plain "
        f"{part['engine_plain_tokens_per_s']:.1f} tokens/s, with drafts "
        f"{part['engine_lookup_tokens_per_s']:.1f} tokens/s: {part['engine_speedup']:.2f}x "
        f"[reach >= {REACH_LOOKUP}x: {mark(part['engine_speedup'] >= REACH_LOOKUP)}]; "
        f"acceptance {part['engine_acceptance_rate']:.0%}, "
        f"{part['engine_tokens_per_step']:.2f} tokens a step; identical tokens: "
        f"{part['engine_identical']}",
    ]


def report_int8(part: dict[str, Any]) -> list[str]:
    return [
        f"3. int8 vs fp32 (evaluate_int8.py): greedy agreement over {part['prompts']} prompts x "
        f"{part['agree_tokens']} tokens: {part['agreement']:.1%} of positions before the first "
        f"divergence, {part['full_matches']}/{part['prompts']} identical",
        f"   {'':6}{'perplexity':>12}{'tokens/s':>10}{'proj MiB':>10}   (perplexity on "
        f"{part['paragraphs']} paragraphs)",
        f"   {'fp32':6}{part['ppl_fp32']:>12.3f}{part['tokens_per_s_fp32']:>10.1f}"
        f"{part['projection_mib_fp32']:>10.1f}",
        f"   {'int8':6}{part['ppl_int8']:>12.3f}{part['tokens_per_s_int8']:>10.1f}"
        f"{part['projection_mib_int8']:>10.1f}",
        f"   int8/fp32: perplexity x{part['ppl_ratio']:.3f}, decode speed x{part['speedup']:.2f} "
        f"(batch 1, {part['new_tokens']} tokens, best of 3)",
    ]


def report_platform(part: dict[str, Any]) -> list[str]:
    remote, local = part["platform"]["bench"], part["in_process"]
    ms = 1000.0
    lines = [
        f"4. TTFT, {part['requests']} requests ({part['prompts']} chat prompts in turn, "
        f"{part['new_tokens']} new tokens, stop at end of turn), Poisson {part['rate']:g}/s, "
        f"seed {part['seed']}",
        f"   {'':34}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'E2E p50':>9}",
    ]
    for title, side in (("ember bench through the platform", remote), ("Engine in-process", local)):
        t, e = side["latency_s"]["ttft"], side["latency_s"]["e2e"]
        lines.append(
            f"   {title:34}{t['p50'] * ms:>9.1f}{t['p95'] * ms:>9.1f}{t['p99'] * ms:>9.1f}"
            f"{t['mean'] * ms:>9.1f}{e['p50'] * ms:>9.1f}"
        )
    added = part["ttft_added_s"]
    requests = remote["requests"]
    lines += [
        f"   the platform adds {added['p50'] * ms:.1f} ms at P50 and {added['p99'] * ms:.1f} ms "
        f"at P99 to TTFT",
        f"   platform: {requests['ok']}/{requests['finished']} ok, "
        f"{remote['output_tokens_per_s']:.1f} output tokens/s; first call (replica boot) "
        f"{part['platform']['first_call_s']:.1f} s; {part['platform']['snapshot']}; replicas "
        f"after: {part['platform']['replicas_after']}",
    ]
    return lines


def report(result: dict[str, Any]) -> str:
    setup, verdict = result["setup"], result["verdicts"]
    head = (
        f"LLM example: {setup['model']}, {setup['parameters'] / 1e6:.0f} M parameters, on CPU: "
        f"torch {setup['torch']} with {setup['threads']} threads on {setup['cpus']} CPUs"
    )
    if "transformers" in setup:
        head += f"; transformers {setup['transformers']}"
    sections = [[head]]
    for number, (name, write) in enumerate(
        (
            ("batching", report_batching),
            ("lookup", report_lookup),
            ("int8", report_int8),
            ("platform", report_platform),
        ),
        start=1,
    ):
        if name in result:
            sections.append(write(result[name]))
        elif f"{name}_error" in result:
            sections.append([f"{number}. {name}: FAILED: {result[f'{name}_error']}"])
    ends: list[str] = []
    if "batching" in result:
        speedup = result["batching"]["speedup_vs_transformers"]
        ends.append(
            f"batching: Engine {speedup:.2f}x transformers one at a time "
            f"(reach >= {REACH_BATCHING:g}x): {mark(verdict['batching_pass'])}"
        )
    if "lookup" in result:
        ends.append(
            f"prompt lookup in the engine: {result['lookup']['engine_speedup']:.2f}x plain "
            f"decoding (reach >= {REACH_LOOKUP:g}x): {mark(verdict['lookup_pass'])}"
        )
        ends.append(
            f"prompt lookup: tokens identical to plain decoding: "
            f"{mark(verdict['lookup_identical_pass'])}"
        )
    if ends:
        sections.append(ends)
    return "\n\n".join("\n".join(lines) for lines in sections)


def parse_parts(text: str) -> list[str]:
    chosen = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        name = PARTS[int(item) - 1] if item in ("1", "2", "3", "4") else item
        if name not in PARTS:
            raise argparse.ArgumentTypeError(f"unknown part {item!r}: choose from {PARTS}")
        chosen.append(name)
    return [p for p in PARTS if p in chosen]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/llm.py",
        description="Benchmark the LLM example (examples/llm, SmolLM2-135M-Instruct in plain "
        "torch on CPU) against its baselines, in one run on one machine: (1 batching) "
        "concurrent chat requests through the continuous-batching Engine vs Hugging Face "
        "transformers' generate one request at a time, output tokens/s "
        f"(reach >= {REACH_BATCHING:g}x); (2 lookup) prompt-lookup speculative decoding vs "
        f"plain greedy decoding at batch 1 (reach >= {REACH_LOOKUP:g}x, tokens identical); "
        "(3 int8) int8 weights vs fp32: tokens/s, perplexity, greedy agreement; (4 platform) "
        "`ember bench` at the deployed example in a temporary `ember server` vs the same "
        "prompts and Poisson arrivals into an in-process Engine: the TTFT the platform adds "
        "at P50 and P99. The model is converted into --dir first if it is not there; "
        "transformers loads it from there offline.",
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error or "
        "when a part failed (with --quick: 0 once every verdict is printed).",
    )
    parser.add_argument(
        "--parts",
        type=parse_parts,
        default=list(PARTS),
        metavar="LIST",
        help="comma-separated parts to run, by name or number: batching (1), lookup (2), "
        "int8 (3), platform (4) (default: all)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help="the converted model (default: ~/.cache/ember/llm/smollm2)",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        metavar="N",
        help="new tokens per request in parts 1-3 (default: 64; --quick: 8)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="concurrent requests in part 1, each a different chat prompt up to 8 (default: 8; "
        "--quick: 2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="part 1's rounds, every path once each, best kept (default: 2; --quick: 1)",
    )
    parser.add_argument(
        "--platform-requests",
        type=int,
        metavar="N",
        help="requests in part 4, each side (default: 40; --quick: 6)",
    )
    parser.add_argument(
        "--platform-tokens",
        type=int,
        metavar="N",
        help="max_new_tokens of part 4's requests (default: 16; --quick: 4)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="part 4's Poisson arrivals per second (default: 1.5; --quick: 3)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds part 4's arrivals, both sides (default: 0)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        metavar="N",
        help="torch threads for every in-process path (default: the CPUs available)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every part at its smallest: fewer requests and tokens, one round or attempt, "
        "part 3 on 1 prompt x 8 tokens and 2 paragraphs, part 4 eager and without "
        "snapshots; the verdicts are printed, not judged by the exit status",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--keep", action="store_true", help="keep part 4's temporary state dir (logs)"
    )
    args = parser.parse_args(argv)
    defaults = {
        "new_tokens": (64, 8),
        "requests": (8, 2),
        "rounds": (2, 1),
        "platform_requests": (40, 6),
        "platform_tokens": (16, 4),
        "rate": (1.5, 3.0),
        # Not options: part 2's attempts each way, part 3's prompts and tokens compared.
        "lookup_attempts": (3, 1),
        "int8_prompts": (8, 1),
        "int8_paragraphs": (None, 2),  # None: all of evaluate_int8.py's
        "agree_tokens": (32, 8),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)
    counts = (args.new_tokens, args.requests, args.rounds, args.platform_requests)
    counts += (args.platform_tokens,)
    if min(counts) < 1 or args.rate <= 0 or args.threads < 1:
        parser.error("counts, --rate and --threads must be positive")
    if args.new_tokens < 3:
        parser.error("--new-tokens: at least 3 (prompt lookup drafts need room)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global QUIET
    args = parse_args(argv)
    QUIET = args.quiet
    args.dir = args.dir.expanduser()
    os.environ["HF_HUB_OFFLINE"] = "1"  # transformers must never download
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["EMBER_LLM_DIR"] = str(args.dir)  # app.py, imported for its settings
    if args.quick:
        os.environ["EMBER_LLM_COMPILE"] = "0"  # the in-process engine eager, as the replica's
    # SIGTERM unwinds like Ctrl+C, so part 4's server is always stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("interrupted; the server and its processes are stopped", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
        print(f"bench/llm.py: {exc}", file=sys.stderr)
        return 2
    result["verdicts"] = verdicts(result)
    print(json.dumps(result, indent=2) if args.json else report(result))
    if failed := failed_parts(result):
        for name in failed:
            print(f"bench/llm.py: {name} failed: {result[f'{name}_error']}", file=sys.stderr)
        return 2
    if args.quick:  # a few tokens: the verdicts are printed, not judged
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
