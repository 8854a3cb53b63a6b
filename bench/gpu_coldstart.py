"""GPU cold starts of the LLM example: restored with its CUDA graphs vs booted cold.

For each model (SmolLM2-135M's shape, then SmolLM2-360M's: 1.45 GB of fp32 weights,
random, written by bench/llm_models.py), one `ember server` on this GPU node gets
examples/llm deployed twice, asking for one GPU: app `restore` with snapshots on (its
first replica boots cold, compiles the decode step, captures its CUDA graphs in
`enter(snap=True)` and is checkpointed: device memory through the CUDA driver, then
CRIU) and app `cold` with snapshots off. Every measured call starts from zero replicas
and the two paths alternate in rounds. Each call streams the same greedy request; it is
timed from sending it to the first streamed token (the figure users wait on) and to
its last token.

Reported per model: both paths' times and their ratio, the platform's start phases
(placement to ready, CRIU's restore, the CUDA driver's restore of device memory, enter,
first input), the image's size, the device memory the replica holds and the rate it
came back at against this machine's host-to-device copy rate, graphs captured and
compiled after the warm-up, and the tokens. Verdicts: restored <= 10 % of cold (to the
first token); device memory restored at >= half the pinned host-to-device rate; the
same tokens from every replica; no CUDA graph captured and nothing compiled by a
restored replica.

Cold boots run in the platform's sandbox like every replica. By default each app's
replicas share a compile cache (Inductor's, which holds Triton's) that the worker shows
them, and the cold app's starts as a copy of what the restore app's first boot compiled:
the measured cold boots are the cold path's best case, a node that compiled this model
before (their cache hits and misses are shown); the restore app's first boot, from an
empty cache, is the fresh node's case, reported beside. `--fresh-compile` leaves each
replica its own empty cache instead. Should a
sandboxed GPU replica fail its first boot (the sandbox has not met a GPU before), that
is reported as a failed verdict and the model is measured again with `--no-sandbox`, so
that one run on a lent GPU machine still gives the start figures.

    python3 bench/gpu_coldstart.py                      # on the GPU machine, as root
    python3 bench/gpu_coldstart.py --models 135m --rounds 3
    .venv/bin/python bench/gpu_coldstart.py --device cpu --layers 2   # a CPU dry run

Without CUDA (and no --device) it prints "skipped: no NVIDIA GPU" and exits 0. Exit
status 0 when every verdict passes, 1 when one misses, 2 on error. bench/gpu_checks.sh
runs it as the `coldstart` check.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from llm_models import SHAPES, write_model
from procs import ServerProcess, isolated_env, progress, server_url, stopped_at_exit

REACH_RESTORE_RATIO = 0.10
REACH_COPY_RATE = 0.5  # device memory restored at >= this share of pinned H2D copies
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm" / "app.py"
ENDPOINT = "llm"
PATHS = ("cold", "restore")  # the two apps of each model
PROMPT = [1, 4093, 198, 1010, 2020, 3030, 4040, 5050]
SCALEDOWN_S = 4.0  # long enough to ask the replica for its stats after its answer
BOOT_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 420.0  # a first boot compiles and captures every graph
ZERO_TIMEOUT_S = 120.0
SNAPSHOT_TIMEOUT_S = 300.0
POLL_S = 0.1
COPY_BYTES = 1 << 30  # the host-to-device probe's size


def skip_without_gpu(device: str | None) -> bool:
    return device is None and shutil.which("nvidia-smi") is None


# ===================================================================================
# This machine: its GPU type and its host-to-device copy rate.
# ===================================================================================


def gpu_type() -> str:
    """This machine's first GPU's type, as the worker offers it and endpoints ask."""
    from ember.declarations.settings import GPU_TYPES
    from ember_worker.resources import detect_gpus

    devices = detect_gpus()
    if not devices:
        raise RuntimeError("nvidia-smi lists no GPU")
    if devices[0].kind not in GPU_TYPES:
        raise RuntimeError(f"this GPU ({devices[0].kind}) is not a type endpoints ask for")
    return devices[0].kind


COPY_PROBE = """
import json, statistics, sys, time, torch
size = int(sys.argv[1]) // 4
device = torch.empty(size, device="cuda")
rates = {}
for kind in ("pinned", "pageable"):
    host = torch.ones(size, pin_memory=kind == "pinned")
    seconds = []
    for _ in range(6):
        torch.cuda.synchronize()
        began = time.perf_counter()
        device.copy_(host, non_blocking=kind == "pinned")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    rates[kind] = size * 4 / statistics.median(seconds[1:]) / 1e9
print(json.dumps(rates))
"""


def copy_rates() -> dict[str, float]:
    """Host-to-device GB/s, pinned and pageable, in a process of its own (this one
    holds no CUDA context: the device memory figures count the replica's alone)."""
    result = subprocess.run(
        [sys.executable, "-c", COPY_PROBE, str(COPY_BYTES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the host-to-device probe failed:\n{result.stderr[-2000:]}")
    return {k: float(v) for k, v in json.loads(result.stdout.splitlines()[-1]).items()}


def gpu_memory_used() -> int | None:
    """Bytes of device memory in use on this machine's GPUs, as the driver counts them
    (per-process figures are not used: nvidia-smi may not see into PID namespaces)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return sum(int(line) for line in out.split()) * 2**20
    return None


class DeviceMemory:
    """What a replica holds on the GPUs: the driver's count less what was in use before
    any replica ran (none runs beside it: the paths never overlap)."""

    def __init__(self, on_gpu: bool) -> None:
        self.baseline = gpu_memory_used() if on_gpu else None

    def held(self) -> int | None:
        if self.baseline is None or (used := gpu_memory_used()) is None:
            return None
        return used - self.baseline


# ===================================================================================
# The platform's API and gateway, over HTTPS with the server's CA.
# ===================================================================================


class Platform:
    def __init__(self, url: str, token: str, ca: Path, server: ServerProcess) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 443
        self.headers = {"Authorization": f"Bearer {token}"}
        self.context = ssl.create_default_context(cafile=str(ca))
        self.server = server

    def _connection(self, timeout: float) -> http.client.HTTPSConnection:
        connection = http.client.HTTPSConnection(
            self.host, self.port, context=self.context, timeout=timeout
        )
        connection.connect()  # the TLS handshake before any clock starts
        return connection

    def _send(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        """(status, body) of one request on a connection of its own; `body` as JSON."""
        headers = dict(self.headers)
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        connection = self._connection(timeout)
        try:
            connection.request(method, path, data, headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def get(self, path: str) -> Any:
        status, body = self._send("GET", path, None, 30)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status} {body[:300]!r}")
        return json.loads(body)

    def post(self, app: str, method: str, arguments: dict[str, Any]) -> Any:
        status, body = self._send("POST", f"/{app}--{ENDPOINT}/{method}", arguments, CALL_TIMEOUT_S)
        if status != 200:
            raise RuntimeError(f"{app}/{method}: HTTP {status} {body[:500]!r}")
        return json.loads(body)

    def stream(self, app: str, arguments: dict[str, Any]) -> tuple[float, float, list[int]]:
        """`generate` streamed: (seconds to the first token, to the last, the tokens)."""
        connection = self._connection(CALL_TIMEOUT_S)
        headers = {**self.headers, "Content-Type": "application/json"}
        tokens: list[int] = []
        first = float("nan")
        try:
            began = time.perf_counter()
            connection.request(
                "POST", f"/{app}--{ENDPOINT}/generate", json.dumps(arguments).encode(), headers
            )
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"{app}: HTTP {response.status} {response.read()[:500]!r}")
            event = ""
            while line := response.readline():
                text = line.decode().strip()
                if text.startswith("event:"):
                    event = text.removeprefix("event:").strip()
                elif text.startswith("data:"):
                    data = json.loads(text.removeprefix("data:"))
                    if event == "error":
                        raise RuntimeError(f"{app}: the stream ended with an error: {data}")
                    if not tokens:
                        first = time.perf_counter() - began
                    tokens.append(int(data["token_id"]))
            return first, time.perf_counter() - began, tokens
        finally:
            connection.close()

    def endpoint(self, app: str) -> dict[str, Any]:
        for row in self.get("/v1/apps")["endpoints"]:
            if row["label"] == f"{app}--{ENDPOINT}":
                return dict(row)
        raise RuntimeError(f"{app} is not deployed")

    def wait_for_zero(self) -> None:
        deadline = time.monotonic() + ZERO_TIMEOUT_S
        while any(any(row["replicas"].values()) for row in self.get("/v1/apps")["endpoints"]):
            self.server.remember()  # short-lived processes (CRIU, replicas) too
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas did not scale to zero in {ZERO_TIMEOUT_S:g} s")
            time.sleep(POLL_S)

    def wait_for_snapshot(self, app: str) -> float:
        began = time.monotonic()
        while not self.endpoint(app)["snapshots"]:
            self.server.remember()
            if time.monotonic() - began > SNAPSHOT_TIMEOUT_S:
                raise RuntimeError(
                    f"{app} has no snapshot after {SNAPSHOT_TIMEOUT_S:g} s:\n{self.notes(app)}"
                )
            time.sleep(POLL_S)
        return time.monotonic() - began

    def notes(self, app: str) -> str:
        """The app's last log lines, for errors."""
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            _, raw = self._send("GET", f"/v1/apps/{app}/logs?tail=40", None, 30)
            lines = [json.loads(line).get("text", "") for line in raw.splitlines() if line]
            return "\n".join(f"  {app}: {line}" for line in lines)
        return f"  ({app}'s logs could not be read)"


# ===================================================================================
# Measuring one model.
# ===================================================================================


@dataclass
class Sample:
    path: str  # "cold" or "restore"
    round: int
    first_token_s: float  # request to the first streamed token, as the caller saw it
    last_token_s: float
    start: dict[str, Any]  # the replica's start phases (GET /v1/apps -> last_start)
    tokens: list[int]
    graphs: dict[str, int]  # the replica's graph counts after this request
    device_bytes: int | None


class FirstBootFailed(RuntimeError):
    """The first replica of a model never answered (before anything was measured)."""


@dataclass
class ModelRun:
    model: str
    layers: int
    weight_bytes: int
    first_boot: Sample
    startup: dict[str, Any]  # the model as the first replica loaded it
    samples: list[Sample] = field(default_factory=list)
    image: dict[str, Any] = field(default_factory=dict)
    skipped_rounds: int = 0
    sandbox: bool = True
    sandbox_failure: str = ""  # why a sandboxed first boot failed, if one did
    compile_cache: bool = True  # measured cold boots found a warm compile cache


def measure(
    api: Platform, app: str, number: int, arguments: dict[str, Any], memory: DeviceMemory
) -> tuple[Sample, dict[str, Any]]:
    """One call from zero replicas; the sample, and the model as the replica loaded it."""
    api.wait_for_zero()  # the paths never share the GPU or the CPUs
    before = api.endpoint(app).get("last_start")
    first, last, tokens = api.stream(app, arguments)
    # At once, on the replica that answered, before its scale-down window ends.
    device_bytes = memory.held()
    stats = api.post(app, "stats", {})
    start = api.endpoint(app).get("last_start") or {}
    if start == before:
        raise RuntimeError(f"{app} answered without starting a replica")
    path = app.split("-")[0]
    sample = Sample(path, number, first, last, start, tokens, stats["graphs"], device_bytes)
    return sample, stats["model"]


def run_model(
    args: argparse.Namespace,
    work: Path,
    model: str,
    gpu: str | None,
    memory: DeviceMemory,
    deadline: float,
    sandbox: bool = True,
) -> ModelRun:
    folder = work / "models" / model
    progress(args.quiet, f"{model}: writing random weights of its shape ...")
    weight_bytes = write_model(folder, SHAPES[model], args.layers)
    run_name = model if sandbox else f"{model}-no-sandbox"  # a failed try's logs stay
    state = work / f"state-{run_name}"
    # Replicas read these from the server's environment; `ember deploy` reads them for
    # the endpoint's settings (the GPU, snapshots, the weights' URL).
    # One compile cache an app: the snapshot phase (uid 0 without capabilities) and the
    # replicas that serve (their workspace's user) cannot write each other's folders.
    caches = {path: work / f"compile-{run_name}-{path}" for path in PATHS}
    for cache in caches.values():
        cache.mkdir(exist_ok=True)
        cache.chmod(0o1777)
    # The model's folder is shown to sandboxed replicas read-only (--model-dir); the
    # compile caches writable, through the worker's hook for test runs (operators give
    # replicas a writable shared folder as an ember.Volume instead).
    shown = [] if args.fresh_compile else list(caches.values())
    env = isolated_env(
        work,
        EMBER_LLM_DIR=str(folder),
        EMBER_LLM_CONVERT="0",
        EMBER_SANDBOX_WRITABLE=":".join(map(str, shown)),
    )
    # Set in this process by torch's import (writing the weights): replicas would share
    # one compile cache, root's, which an unsandboxed replica's own user cannot write.
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    apps = {path: f"{path}-{model.replace('.', '')}" for path in PATHS}
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    command += ["--port", "0", "--model-dir", str(folder)]
    command += [] if sandbox else ["--no-sandbox"]
    progress(args.quiet, f"{model}: starting ember server ...")
    with stopped_at_exit() as started:
        server = ServerProcess.start("ember server", command, work / f"server-{run_name}.log", env)
        started.append(server)
        url = server_url(server, BOOT_TIMEOUT_S)
        api = Platform(url, (state / "admin-token").read_text().strip(), state / "ca.pem", server)
        for path, app in apps.items():
            deploy_env = {
                **env,
                "EMBER_LLM_SNAPSHOT": "1" if path == "restore" else "0",
                "EMBER_LLM_SCALEDOWN": str(SCALEDOWN_S),
                **({"EMBER_LLM_GPU": gpu} if gpu else {}),
                **({} if args.fresh_compile else {"EMBER_LLM_COMPILE_CACHE": str(caches[path])}),
            }
            deploy = [sys.executable, "-m", "ember.cli.main", "deploy", str(EXAMPLE)]
            done = subprocess.run(
                [*deploy, "--name", app], env=deploy_env, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"ember deploy --name {app} failed:\n{done.stderr}")
        for worker in api.get("/v1/apps")["workers"]:
            if problem := worker["snapshots"].get("problem"):
                raise RuntimeError(f"snapshots are off on this node: {problem}")

        arguments = {"prompt_ids": PROMPT, "max_new_tokens": args.tokens}
        progress(args.quiet, f"{model}: first boot (compile, capture, then the snapshot) ...")
        try:
            first, startup = measure(api, apps["restore"], 0, arguments, memory)
        except RuntimeError as exc:
            raise FirstBootFailed(f"{exc}\n{api.notes(apps['restore'])}") from None
        published = api.wait_for_snapshot(apps["restore"])
        layers = args.layers or SHAPES[model].num_hidden_layers
        result = ModelRun(model, layers, weight_bytes, first, startup, sandbox=sandbox)
        result.compile_cache = not args.fresh_compile
        result.image["published_after_s"] = published
        if not args.fresh_compile:
            # What the first boot compiled, for the cold app's replicas: a copy they may
            # write (their user is not the snapshot phase's), cheaper than a cold boot.
            shutil.copytree(caches["restore"], caches["cold"], dirs_exist_ok=True)
            open_to_all(caches["cold"])
        for number in range(1, args.rounds + 1):
            # A round takes about what the last one took (the first boot for round 1).
            last = [s for s in result.samples if s.round == number - 1] or [first]
            if time.monotonic() + 1.5 * sum(s.last_token_s for s in last) + 30 > deadline:
                result.skipped_rounds = args.rounds - number + 1
                progress(args.quiet, f"{model}: out of time, {result.skipped_rounds} round(s) left")
                break
            for path in PATHS[::-1] if number % 2 else PATHS:
                progress(args.quiet, f"{model}: round {number}/{args.rounds}, {path} ...")
                sample, _ = measure(api, apps[path], number, arguments, memory)
                result.samples.append(sample)
                progress(
                    args.quiet,
                    f"  first token {sample.first_token_s:.2f} s "
                    f"({sample.start.get('kind')} start)",
                )
        api.wait_for_zero()
        result.image.update(image_sizes(api, apps["restore"], state))
    if not args.keep:  # the next model's images need the disk
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    return result


def open_to_all(folder: Path) -> None:
    """Every folder and file under `folder` readable and writable by every user."""
    for root, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(root, name), 0o777)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666)


def image_sizes(api: Platform, app: str, state: Path) -> dict[str, Any]:
    from ember_worker.snapshots.node_cache import image_name

    snapshots = api.endpoint(app)["snapshots"]
    if not snapshots:
        raise RuntimeError(f"{app}'s snapshot is gone:\n{api.notes(app)}")
    snapshot = snapshots[0]
    folder = state / "worker" / "snapshots" / image_name(snapshot["key"], snapshot.get("image_id"))
    files = [
        p for p in (folder / "images").iterdir() if p.is_file() and not p.name.endswith(".log")
    ]
    meta = json.loads((folder / "images" / "meta.json").read_text())
    return {
        "raw_bytes": sum(p.stat().st_size for p in files),
        "compressed_bytes": snapshot["size"],
        "dump_seconds": snapshot.get("dump_seconds"),
        "gpu_checkpoint_seconds": meta.get("cuda_seconds"),
    }


# ===================================================================================
# Summary, verdicts and the report.
# ===================================================================================

PHASES = ("total", "boot", "fetch", "restore", "gpu_restore", "enter", "first_input")


def _median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def summarize(run: dict[str, Any], rates: dict[str, float] | None) -> dict[str, Any]:
    samples = [Sample(**s) for s in run["samples"]]
    cold = [s for s in samples if s.path == "cold"]
    restores = [s for s in samples if s.path == "restore"]
    restored = [s for s in restores if s.start.get("kind") == "restore"]
    cold_first = _median([s.first_token_s for s in cold])
    restore_first = _median([s.first_token_s for s in restored])
    gpu_steps = [s.start.get("gpu_restore_seconds") for s in restored]
    device = _median([s.device_bytes for s in restored])
    gpu_rate = device / _median(gpu_steps) / 1e9 if restored else float("nan")
    reference = run["first_boot"]["tokens"]
    return {
        "cold_first_token_s": cold_first,
        "restore_first_token_s": restore_first,
        "ratio": restore_first / cold_first,
        "ratio_to_first_boot": restore_first / run["first_boot"]["first_token_s"],
        "cold_cache_hits": sum(s.graphs.get("compile_cache_hits", 0) for s in cold),
        "cold_cache_misses": sum(s.graphs.get("compile_cache_misses", 0) for s in cold),
        "cold_last_token_s": _median([s.last_token_s for s in cold]),
        "restore_last_token_s": _median([s.last_token_s for s in restored]),
        "fallbacks": len(restores) - len(restored),
        "phases": {
            path: {p: _median([s.start.get(f"{p}_seconds") for s in group]) for p in PHASES}
            for path, group in (("cold", cold), ("restore", restored))
        },
        "device_bytes": device,
        "gpu_restore_gb_per_s": gpu_rate,
        "copy_rate_share": gpu_rate / rates["pinned"] if rates else float("nan"),
        "tokens_identical": sum(s.tokens == reference for s in samples) + 1,
        "answers": len(samples) + 1,
        "captures_after_restore": sum(s.graphs["cuda_graph_captures_after_warm"] for s in restored),
        "compiles_after_restore": sum(s.graphs["compiled_graphs_after_warm"] for s in restored),
        "captures_at_warm": run["first_boot"]["graphs"]["cuda_graph_captures"]
        - run["first_boot"]["graphs"]["cuda_graph_captures_after_warm"],
    }


def verdicts(summary: dict[str, Any], on_gpu: bool) -> dict[str, bool]:
    # NaN compares false: nothing measured is a miss, never a pass.
    found = {
        "restore_ratio": summary["ratio"] <= REACH_RESTORE_RATIO and not summary["fallbacks"],
        "tokens": summary["tokens_identical"] == summary["answers"],
        "no_recapture": summary["captures_after_restore"] == 0
        and summary["compiles_after_restore"] == 0,
    }
    if on_gpu:
        found["gpu_restore_rate"] = summary["copy_rate_share"] >= REACH_COPY_RATE
    return found


def report(run: dict[str, Any], rates: dict[str, float] | None) -> str:
    summary, verdict = run["summary"], run["verdicts"]
    startup, image, first = run["startup"], run["image"], run["first_boot"]
    gb = 1e9
    lines = [
        f"== {run['model']}: {startup['parameters'] / 1e6:.0f} M parameters, "
        f"{run['layers']} layers, {run['weight_bytes'] / gb:.2f} GB of fp32 weights on "
        f"{startup['device']}, {'in the sandbox' if run['sandbox'] else 'with --no-sandbox'}",
        f"first boot: first token after {first['first_token_s']:.2f} s (load "
        f"{startup['load_seconds']:.1f} s, compile and capture {startup['warm_seconds']:.1f} s, "
        f"{summary['captures_at_warm']} CUDA graphs captured); snapshot published "
        f"{image['published_after_s']:.1f} s later",
        "cold boots: "
        + (
            "a copy of the first boot's compile cache, "
            f"{summary['cold_cache_hits']} hits and {summary['cold_cache_misses']} misses"
            if run["compile_cache"]
            else "each with an empty compile cache of its own (--fresh-compile)"
        ),
        "",
        f"{'request -> first token (s)':30}{'cold':>9}{'restore':>9}{'ratio':>8}",
    ]
    by_round: dict[int, dict[str, Sample]] = {}
    for s in (Sample(**raw) for raw in run["samples"]):
        by_round.setdefault(s.round, {})[s.path] = s
    for number, pair in sorted(by_round.items()):
        if len(pair) < 2:
            continue
        c, r = pair["cold"], pair["restore"]
        note = "" if r.start.get("kind") == "restore" else f"  (booted {r.start.get('kind')})"
        ratio = r.first_token_s / c.first_token_s
        lines.append(
            f"{f'  round {number}':30}{c.first_token_s:>9.2f}{r.first_token_s:>9.2f}"
            f"{ratio:>8.1%}{note}"
        )
    lines.append(
        f"{'  p50':30}{summary['cold_first_token_s']:>9.2f}{summary['restore_first_token_s']:>9.2f}"
        f"{summary['ratio']:>8.1%}"
    )
    lines.append(
        f"{'  first boot (empty cache)':30}{first['first_token_s']:>9.2f}{'':>9}"
        f"{summary['ratio_to_first_boot']:>8.1%}"
    )
    lines.append(
        f"{'  to the last token, p50':30}{summary['cold_last_token_s']:>9.2f}"
        f"{summary['restore_last_token_s']:>9.2f}"
    )
    lines += ["", f"{'start phases, p50 (s)':30}{'cold':>9}{'restore':>9}"]
    for phase in PHASES:
        values = [summary["phases"][p][phase] for p in PATHS]
        lines.append(f"{'  ' + phase.replace('_', ' '):30}{values[0]:>9.3f}{values[1]:>9.3f}")
    lines.append("  (total: placement to ready; restore: CRIU and the GPU step; gpu restore:")
    lines.append("   the CUDA driver putting device memory back; first input: dispatch to result)")
    lines += [
        "",
        f"image: {image['raw_bytes'] / gb:.2f} GB raw, {image['compressed_bytes'] / gb:.2f} GB "
        f"compressed; dumped in {image['dump_seconds'] or float('nan'):.2f} s (GPU checkpoint "
        f"{image['gpu_checkpoint_seconds'] or float('nan'):.2f} s)",
    ]
    if rates:
        lines.append(
            f"device memory of a restored replica: {summary['device_bytes'] / gb:.2f} GB, back "
            f"at {summary['gpu_restore_gb_per_s']:.1f} GB/s; host-to-device copies here: "
            f"{rates['pinned']:.1f} GB/s pinned, {rates['pageable']:.1f} GB/s pageable"
        )
    if summary["fallbacks"]:
        lines.append(f"warning: {summary['fallbacks']} restore(s) booted cold instead")
    if run["skipped_rounds"]:
        lines.append(f"note: {run['skipped_rounds']} round(s) left out for time")

    def mark(name: str) -> str:
        return "PASS" if verdict[name] else "MISS"

    lines += [
        "",
        f"restored: {summary['ratio']:.1%} of cold to the first token "
        f"(reach <= {REACH_RESTORE_RATIO:.0%}): {mark('restore_ratio')}",
        f"tokens: {summary['tokens_identical']} of {summary['answers']} answers the same "
        f"{first['tokens'][:8]}...: {mark('tokens')}",
        f"graphs after a restore: {summary['captures_after_restore']} CUDA graphs captured, "
        f"{summary['compiles_after_restore']} compiled (reach 0): {mark('no_recapture')}",
    ]
    if "gpu_restore_rate" in verdict:
        lines.append(
            f"device memory restored at {summary['copy_rate_share']:.0%} of the pinned copy "
            f"rate (reach >= {REACH_COPY_RATE:.0%}): {mark('gpu_restore_rate')}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    on_gpu = args.device == "cuda"
    deadline = time.monotonic() + args.deadline
    gpu = gpu_type() if on_gpu else None
    memory = DeviceMemory(on_gpu)  # before the probe: it leaves nothing on the GPU
    rates = copy_rates() if on_gpu else None
    if rates:
        progress(args.quiet, f"host-to-device: {rates['pinned']:.1f} GB/s pinned")
    work = Path(tempfile.mkdtemp(prefix="ember-gpu-coldstart-"))
    work.chmod(0o711)  # replicas' users reach the model folder in it (unsandboxed: by path)
    results = []
    sandbox, sandbox_failure = not args.no_sandbox, ""
    try:
        for model in args.models:
            if results and time.monotonic() + 120 > deadline:
                print(f"\n== {model}: left out, under 120 s of the run's time left")
                continue
            try:
                ran = run_model(args, work, model, gpu, memory, deadline, sandbox)
            except FirstBootFailed as exc:
                if not (on_gpu and sandbox):
                    raise
                # Measured all the same, outside the sandbox; the failure is a verdict.
                sandbox, sandbox_failure = False, str(exc)
                print(f"\nFAIL: a sandboxed GPU replica did not boot:\n{exc}", flush=True)
                ran = run_model(args, work, model, gpu, memory, deadline, sandbox)
            ran.sandbox_failure = sandbox_failure
            measured = asdict(ran)
            measured["summary"] = summarize(measured, rates)
            measured["verdicts"] = verdicts(measured["summary"], on_gpu)
            if sandbox_failure:
                measured["verdicts"]["sandboxed_gpu_replica"] = False
            measured["copy_rates"] = rates
            results.append(measured)
            if not args.json:
                print(report(measured, rates), flush=True)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_coldstart.py",
        description="Time the LLM example's starts from zero replicas on a GPU node: "
        "booted cold (load, torch.compile, CUDA-graph capture) and restored from a "
        "snapshot taken after all that, to the first streamed token, for models of "
        "SmolLM2's shapes with random weights. Needs root, CRIU, and on a GPU the NVIDIA "
        "driver 570+ with cuda-bindings (as `ember server` does for GPU snapshots).",
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error.",
    )
    parser.add_argument(
        "--models",
        type=lambda text: text.split(","),
        default=["135m", "360m"],
        metavar="A,B",
        help=f"model shapes, in order (of {', '.join(SHAPES)}; default: 135m,360m)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        metavar="N",
        help="rounds per model, each one cold and one restored call (default: 2)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=16,
        metavar="N",
        help="new tokens per call, greedy (default: 16)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="fewer layers than the shape's: for dry runs",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="cpu: a dry run on a machine without a GPU (default: cuda, skipped without one)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=330.0,
        metavar="SECONDS",
        help="rounds and models that would not fit are left out (default: 330)",
    )
    parser.add_argument(
        "--fresh-compile",
        action="store_true",
        help="cold boots each compile from an empty cache, as on a fresh node (default: "
        "they share a cache an unmeasured cold boot filled, the cold path's best case)",
    )
    parser.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run `ember server --no-sandbox` (default: replicas sandboxed, as in production)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary folder (logs, images)"
    )
    args = parser.parse_args(argv)
    if unknown := [m for m in args.models if m not in SHAPES]:
        parser.error(f"--models: unknown {', '.join(unknown)} (of {', '.join(SHAPES)})")
    if args.rounds < 1 or not 1 <= args.tokens <= 100 or (args.layers or 1) < 1:
        parser.error("--rounds and --layers must be positive, --tokens 1 to 100")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if skip_without_gpu(args.device):
        print("skipped: no NVIDIA GPU (nvidia-smi is not here); --device cpu for a dry run")
        return 0
    args.device = args.device or "cuda"
    try:
        results = run(args)
    except KeyboardInterrupt:
        print("interrupted; the server and its processes are stopped", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"bench/gpu_coldstart.py: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results, indent=2))
    missed = [f"{r['model']} {k}" for r in results for k, ok in r["verdicts"].items() if not ok]
    print(f"\n{'every verdict passed' if not missed else 'missed: ' + ', '.join(missed)}")
    return 1 if missed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
