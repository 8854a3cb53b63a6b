"""Cold start: a scaled-to-zero endpoint answering from a cold boot vs from a restore.

The endpoint is examples/transformer: `enter(snap=True)` imports torch, builds a ~430 MB
fp32 decoder-only transformer and warms it with `torch.compile`. The same file is
deployed twice into one `ember server`: as app `restore` with snapshots on (its first
replica boots cold and is checkpointed; later ones restore the image) and as app `cold`
with snapshots off. Every call starts from zero replicas; the two paths alternate in
rounds. A call is timed from the request to the answer on an open TLS connection.

Reported: request-to-answer time of each path (each round and p50), their ratio, where
a start spent its time (the platform's start phases), the image's size, the restore
step's GB/s, and the time to read the image from the page cache, with verdicts against
the reach: the restore path <= 10 % of the cold path, the restore step <= 2x the
page-cache read. Every answer must be the same token ids.

With --weights both apps load the model's weights through `weights=` from a safetensors
file instead of building them. The restored app's tensors then stay mappings of the
node's weights cache, out of the image; the report adds a page-cache read of the image
together with those files.

    .venv/bin/python bench/coldstart.py           # about 4 minutes on 2 CPUs
    .venv/bin/python bench/coldstart.py --json    # machine-readable
    .venv/bin/python bench/coldstart.py --weights # weights mapped, not in the image
    .venv/bin/python bench/coldstart.py --quick   # one round, eager: about a minute

With --quick: one round of 2-token calls, one timed page-cache read, and the replicas
run the model eager (TORCHDYNAMO_DISABLE=1 in their environment: torch.compile does
nothing), so that no boot spends minutes compiling and no cold boot is needed to fill a
compile cache: every part and verdict, of an eager model's cold boot and restore.
A run that fails part-way prints what it measured before, and which part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import mmap
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from procs import ServerProcess, isolated_env, progress, server_url, stopped_at_exit

REACH_RESTORE_RATIO = 0.10
REACH_PAGE_CACHE_RATIO = 2.0
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformer" / "app.py"
ENDPOINT = "lm"  # the example's endpoint name
PATHS = ("cold", "restore")  # also the app names
PROMPT = [1, 2, 3, 4]
BOOT_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 600.0  # a first boot on a slow machine compiles for a minute or more
ZERO_TIMEOUT_S = 120.0
SNAPSHOT_TIMEOUT_S = 300.0
MEMORY_IN_TIMEOUT_S = 30.0
POLL_S = 0.1
READ_CHUNK = 16 * 1024 * 1024
# Log lines worth showing: what the platform said about snapshots, and what failed.
NOTE_PATTERN = re.compile(r"snapshot|restor|criu|fail|error|traceback|booting cold", re.I)


def label(path: str) -> str:
    return f"{path}--{ENDPOINT}"


# ===================================================================================
# Processes: `ember server` in a session of its own, and every process it starts.
# ===================================================================================


@contextlib.contextmanager
def server_process(
    command: Sequence[str], log: Path, env: dict[str, str]
) -> Iterator[ServerProcess]:
    with stopped_at_exit() as started:
        server = ServerProcess.start("ember server", command, log, env)
        started.append(server)
        yield server


# ===================================================================================
# The platform's API and gateway, over HTTPS with the server's CA.
# ===================================================================================


class Platform:
    def __init__(self, url: str, token: str, ca: Path, server: ServerProcess) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 443
        self.token = token
        self.context = ssl.create_default_context(cafile=str(ca))
        self.server = server
        self.lazy_restore = False  # whether memory arrives after the restore step
        self.huge_pages = False  # whether restores go into 2 MiB pages

    def worker_setting(self, name: str) -> bool:
        """A restore setting of the worker, from its hello (it has registered before the
        server said it is serving): `lazy_restore` or `huge_pages`."""
        workers = self.get("/v1/apps")["workers"]
        return any(w["snapshots"].get(name) for w in workers)

    def _connect(self, timeout: float) -> http.client.HTTPSConnection:
        connection = http.client.HTTPSConnection(
            self.host, self.port, context=self.context, timeout=timeout
        )
        connection.connect()
        return connection

    def request(
        self, method: str, path: str, body: bytes | None = None, timeout: float = 30.0
    ) -> tuple[int, bytes, float]:
        """(status, body, seconds from sending the request to the whole answer)."""
        connection = self._connect(timeout)  # TLS handshake before the clock starts
        try:
            headers = {"Authorization": f"Bearer {self.token}"}
            if body is not None:
                headers["Content-Type"] = "application/json"
            started = time.perf_counter()
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
            return response.status, data, time.perf_counter() - started
        finally:
            connection.close()

    def get(self, path: str) -> Any:
        status, data, _ = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status} {data[:300]!r}")
        return json.loads(data)

    def call(self, path: str, method: str, arguments: dict[str, Any]) -> tuple[Any, float]:
        status, data, seconds = self.request(
            "POST", f"/{label(path)}/{method}", json.dumps(arguments).encode(), CALL_TIMEOUT_S
        )
        if status != 200:
            raise RuntimeError(
                f"{label(path)}/{method}: HTTP {status} {data[:500]!r}\n"
                + "\n".join(self.notes(path)[-10:])
            )
        return json.loads(data), seconds

    def endpoint(self, path: str) -> dict[str, Any]:
        for row in self.get("/v1/apps")["endpoints"]:
            if row["label"] == label(path):
                return dict(row)
        raise RuntimeError(f"{label(path)} is not deployed")

    def wait_for_zero(self, paths: Sequence[str]) -> float:
        """Poll until no replica of these endpoints is left; returns the seconds waited."""
        started = time.monotonic()
        while True:
            self.server.remember()  # catch short-lived processes (CRIU, replicas) too
            rows = {r["label"]: r for r in self.get("/v1/apps")["endpoints"]}
            busy = {p: rows[label(p)]["replicas"] for p in paths if _live(rows[label(p)])}
            if not busy:
                return time.monotonic() - started
            if time.monotonic() - started > ZERO_TIMEOUT_S:
                waited = f"{ZERO_TIMEOUT_S:g} s"
                raise RuntimeError(f"replicas did not scale to zero in {waited}: {busy}")
            time.sleep(POLL_S)

    def wait_for_memory_in(self, app: str, start: dict[str, Any]) -> dict[str, Any]:
        """A lazily restored replica's start, once all of its memory is in (reported
        after the restore, often after the answer)."""
        deadline = time.monotonic() + MEMORY_IN_TIMEOUT_S
        while "memory_in_seconds" not in start and time.monotonic() < deadline:
            time.sleep(POLL_S)
            start = self.endpoint(app).get("last_start") or start
        return start

    def wait_for_snapshot(self, app: str) -> float:
        """Poll until the app's snapshot is published (compressed and uploaded after the
        dump, while its replica serves on); returns the seconds waited."""
        started = time.monotonic()
        while not self.endpoint(app)["snapshots"]:
            self.server.remember()
            if time.monotonic() - started > SNAPSHOT_TIMEOUT_S:
                raise RuntimeError(
                    f"the {app} app has no snapshot after {SNAPSHOT_TIMEOUT_S:g} s:\n"
                    + "\n".join(self.notes(app))
                )
            time.sleep(POLL_S)
        return time.monotonic() - started

    def notes(self, app: str, limit: int = 5000) -> list[str]:
        """Log lines about snapshots and failures (`ember logs APP`, filtered)."""
        status, data, _ = self.request("GET", f"/v1/apps/{app}/logs?tail={limit}")
        if status != 200:
            return [f"(logs of {app}: HTTP {status})"]
        lines = []
        for raw in data.splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(raw)
                text = str(entry.get("text", ""))
                if NOTE_PATTERN.search(text):
                    stamp = time.strftime("%H:%M:%S", time.localtime(entry.get("ts", 0)))
                    lines.append(f"{stamp} {app} [{entry.get('stream', '')}] {text}")
        return lines


def _live(row: dict[str, Any]) -> bool:
    return any(count for count in row["replicas"].values())


# ===================================================================================
# Measuring.
# ===================================================================================


@dataclass
class Sample:
    path: str  # "cold" or "restore"
    round: int
    seconds: float  # request to answer, as the caller saw it
    start: dict[str, Any]  # the replica's start phases (GET /v1/apps -> last_start)
    tokens: list[int]


def measure(api: Platform, path: str, number: int, arguments: dict[str, Any]) -> Sample:
    api.wait_for_zero(PATHS)  # neither path's replica may share the CPUs with this one
    if path == "restore" and not api.endpoint("restore")["snapshots"]:
        raise RuntimeError("the restore app has no snapshot:\n" + "\n".join(api.notes(path)))
    before = api.endpoint(path).get("last_start")
    answer, seconds = api.call(path, "generate", arguments)
    start = api.endpoint(path).get("last_start") or {}
    if start == before:
        raise RuntimeError(f"{label(path)} answered without starting a replica")
    if api.lazy_restore and start.get("kind") == "restore":
        start = api.wait_for_memory_in(path, start)
    return Sample(path, number, seconds, start, list(answer["tokens"]))


def image_files(images: Path) -> list[Path]:
    """What a restore reads: every image file (CRIU's logs are not part of the image)."""
    return sorted(p for p in images.iterdir() if p.is_file() and not p.name.endswith(".log"))


def read_seconds(files: Sequence[Path]) -> float:
    """Read every file from the page cache into one reused buffer: the copy alone."""
    buffer = memoryview(bytearray(READ_CHUNK))
    started = time.perf_counter()
    for path in files:
        with path.open("rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    return time.perf_counter() - started


def read_fresh_seconds(files: Sequence[Path], huge: bool = False) -> float:
    """Read every file from the page cache into new anonymous memory, as a restore fills
    the process's memory: the copy plus a page fault (and a zeroed page) per page, or per
    2 MiB page with `huge` (as `--huge-pages` restores)."""
    regions: list[mmap.mmap] = []
    started = time.perf_counter()
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        region = mmap.mmap(-1, size)
        if huge:
            region.madvise(mmap.MADV_HUGEPAGE)
        regions.append(region)
        with path.open("rb", buffering=0) as handle, memoryview(region) as view:
            done = 0
            while done < size and (count := handle.readinto(view[done:])):
                done += count
    seconds = time.perf_counter() - started
    for region in regions:  # unmapping is not part of a restore
        region.close()
    return seconds


def page_cache_reads(files: Sequence[Path], repeats: int, huge: bool) -> dict[str, list[float]]:
    read_seconds(files)  # the warm read: now the image is in the page cache
    return {
        "reused_buffer": [read_seconds(files) for _ in range(repeats)],
        "fresh_memory": [read_fresh_seconds(files, huge) for _ in range(repeats)],
    }


def write_weights(path: Path, env: dict[str, str]) -> None:
    """The example's seeded weights as safetensors (`save_weights`), in a process of
    their own: the benchmark's own memory stays small."""
    script = "import runpy, sys; runpy.run_path(sys.argv[1])['save_weights'](sys.argv[2])"
    result = subprocess.run(
        [sys.executable, "-c", script, str(EXAMPLE), str(path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"writing the example's weights failed:\n{result.stderr}")


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills `result` as each part ends (result["failed"] names the part a failure
    happens in), so that a failure leaves what the parts before measured."""
    work = Path(tempfile.mkdtemp(prefix="ember-coldstart-"))
    try:
        _run(args, work, result)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> None:
    result["failed"] = {"part": "starting the platform", "error": ""}  # until the end
    state = work / "state"
    # Each app's replicas share a compile cache of this run's own (a sandboxed replica's
    # would be its private /tmp's): the restore app's first boot fills one, an unmeasured
    # cold boot the other, so the measured cold boots hit it, like a node that has
    # compiled this model before. That is the cold path's best case; the first boot shows
    # the worst. One a path: a snapshot phase runs as uid 0 and the replicas that serve as
    # their workspace's user, and neither may write the other's folders. The worker shows
    # sandboxed replicas these folders (and no other of the node's).
    caches = {path: work / f"inductor-{path}" for path in PATHS}
    for cache in caches.values():
        cache.mkdir()
        cache.chmod(0o1777)
    work.chmod(0o711)
    # --quick: torch.compile does nothing in the replicas (compiling takes minutes here).
    eager = {"TORCHDYNAMO_DISABLE": "1"} if args.quick else {}
    env = isolated_env(work, EMBER_SANDBOX_WRITABLE=":".join(map(str, caches.values())), **eager)
    if not args.compile_cache:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # every boot compiles afresh
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    command += ["--port", "0"]
    weights_dir = work / "weights"  # shown to sandboxed replicas, read-only
    if args.weights:
        weights_dir.mkdir(mode=0o755)
        command += ["--model-dir", str(weights_dir)]
    if args.lazy_restore:
        command.append("--lazy-restore")
    if args.huge_pages:
        command.append("--huge-pages")
    progress(args.quiet, "starting ember server ...")
    with server_process(command, work / "server.log", env) as server:
        url = server_url(server, BOOT_TIMEOUT_S)
        token = (state / "admin-token").read_text().strip()
        api = Platform(url, token, state / "ca.pem", server)
        api.lazy_restore = api.worker_setting("lazy_restore")
        api.huge_pages = api.worker_setting("huge_pages")
        if args.huge_pages and not api.huge_pages:
            raise RuntimeError("the worker does not restore into huge pages (see server.log)")
        weights_env = {}
        if args.weights:
            weights_file = weights_dir / "model.safetensors"
            progress(args.quiet, "writing the model's seeded weights as safetensors ...")
            write_weights(weights_file, env)
            weights_env["EMBER_EXAMPLE_WEIGHTS"] = weights_file.as_uri()
        for path in PATHS:
            deploy_env = {
                **env,
                **weights_env,
                "EMBER_EXAMPLE_SNAPSHOT": "1" if path == "restore" else "0",
                "EMBER_EXAMPLE_SCALEDOWN": str(args.scaledown),
                "EMBER_EXAMPLE_COMPILE_CACHE": str(caches[path]),
            }
            deploy = [sys.executable, "-m", "ember.cli.main", "deploy", str(EXAMPLE)]
            deployed = subprocess.run(
                [*deploy, "--name", path], env=deploy_env, capture_output=True, text=True
            )
            if deployed.returncode != 0:
                raise RuntimeError(f"ember deploy --name {path} failed:\n{deployed.stderr}")
        server.remember()
        for worker in api.get("/v1/apps")["workers"]:
            if worker["snapshots"].get("problem"):
                raise RuntimeError(f"snapshots are off: {worker['snapshots']['problem']}")

        arguments = {"prompt_ids": PROMPT, "max_new_tokens": args.tokens}
        result["setup"] = {
            "rounds": args.rounds,
            "prompt_ids": PROMPT,
            "max_new_tokens": args.tokens,
            "scaledown_window": args.scaledown,
            "cpus": len(os.sched_getaffinity(0)),
            "compile_cache": args.compile_cache,
            "compiled": not args.quick,
            "lazy_restore": api.lazy_restore,
            "huge_pages": api.huge_pages,
            "weights_through_cache": args.weights,
        }
        result["failed"]["part"] = "the first boot"
        progress(args.quiet, "first call: a cold boot (an empty compile cache), then the dump ...")
        reference, first_seconds = api.call("restore", "generate", arguments)
        first_start = api.endpoint("restore").get("last_start") or {}
        result["first_boot"] = {"seconds": first_seconds, "start": first_start}
        result["reference_tokens"] = reference["tokens"]
        # Right away, on the same replica (the scale-down window is seconds long).
        info, _ = api.call("restore", "info", {})
        result["setup"]["model"] = info
        # Measured once the image is published: compressing it would compete for the CPUs.
        result["failed"]["part"] = "the snapshot"
        published_after = api.wait_for_snapshot("restore")
        if args.compile_cache and not args.quick:  # eager: nothing to compile
            result["failed"]["part"] = "the cold boot that fills the compile cache"
            progress(args.quiet, "a cold boot that fills the cold app's compile cache ...")
            api.wait_for_zero(PATHS)
            api.call("cold", "generate", arguments)
        rounds: list[Sample] = []
        result["samples"] = []
        for number in range(args.rounds):
            order = PATHS[::-1] if number % 2 == 0 else PATHS
            for path in order:
                result["failed"]["part"] = f"round {number + 1}, {path}"
                progress(args.quiet, f"round {number + 1}/{args.rounds}: {path} ...")
                sample = measure(api, path, number, arguments)
                rounds.append(sample)
                result["samples"].append(asdict(sample))
                progress(args.quiet, f"  {sample.seconds:.2f} s ({sample.start.get('kind')} start)")
        result["failed"]["part"] = "reading the image"
        api.wait_for_zero(PATHS)

        row = api.endpoint("restore")
        snapshots = row["snapshots"]
        if not snapshots:
            raise RuntimeError("the snapshot is gone:\n" + "\n".join(api.notes("restore")))
        snapshot = snapshots[0]
        from ember_worker.snapshots.node_cache import (
            image_name,  # the node cache's folder of an image
        )

        folder = image_name(snapshot["key"], snapshot.get("image_id"))
        images = state / "worker" / "snapshots" / folder / "images"
        files = image_files(images)
        progress(args.quiet, f"reading the image ({len(files)} files) from the page cache ...")
        reads = page_cache_reads(files, args.read_repeats, api.huge_pages)
        meta = json.loads((images / "meta.json").read_text())
        mapped = [Path(entry["path"]) for entry in meta.get("mapped_weights") or ()]
        with_mapped: list[float] = []
        if mapped:
            progress(args.quiet, "reading the image and the weights it maps ...")
            read_seconds(files + mapped)  # warm
            with_mapped = [read_seconds(files + mapped) for _ in range(args.read_repeats)]
        notes = api.notes("restore") + api.notes("cold")

    result["image"] = {
        "key": snapshot["key"],
        "compressed_bytes": snapshot["size"],
        "raw_bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
        "dump_seconds": snapshot["dump_seconds"],
        "published_after_answer_seconds": published_after,
        "page_cache_read_seconds": reads["reused_buffer"],
        "fresh_memory_read_seconds": reads["fresh_memory"],
        "mapped_files": len(mapped),
        "mapped_bytes": sum(p.stat().st_size for p in mapped),
        "with_mapped_read_seconds": with_mapped,
    }
    result["notes"] = notes
    del result["failed"]


# ===================================================================================
# Summary, verdicts and the report.
# ===================================================================================


PHASES = ("total", "boot", "fetch", "restore", "enter", "first_input", "memory_in")


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    samples = [Sample(**s) for s in result["samples"]]
    image = result["image"]
    by_path = {p: [s for s in samples if s.path == p] for p in PATHS}
    # A restore that fell back to a cold boot is not a restore: reported, not averaged.
    restored = [s for s in by_path["restore"] if s.start.get("kind") == "restore"]
    fallbacks = len(by_path["restore"]) - len(restored)
    cold = statistics.median(s.seconds for s in by_path["cold"])
    restore = statistics.median(s.seconds for s in restored) if restored else float("nan")
    steps = [float(s.start.get("restore_seconds", 0.0)) for s in restored]
    step = statistics.median(steps) if steps else float("nan")
    read = statistics.median(image["page_cache_read_seconds"])
    fresh = statistics.median(image["fresh_memory_read_seconds"])
    round_ratio = [
        r.seconds / c.seconds
        for c, r in zip(by_path["cold"], by_path["restore"], strict=True)
        if r.start.get("kind") == "restore"
    ]
    phases = {
        p: {
            phase: statistics.median(float(s.start.get(f"{phase}_seconds", 0.0)) for s in group)
            for phase in PHASES
        }
        for p, group in (("cold", by_path["cold"]), ("restore", restored))
        if group
    }
    answers = [s.tokens for s in samples]
    with_mapped = image.get("with_mapped_read_seconds") or []
    with_mapped_read = statistics.median(with_mapped) if with_mapped else float("nan")
    return {
        "with_mapped_read_s": with_mapped_read,
        "step_over_read_with_mapped": step / with_mapped_read,
        "cold_p50_s": cold,
        "restore_p50_s": restore,
        "cold_by_round_s": [s.seconds for s in by_path["cold"]],
        "restore_by_round_s": [s.seconds for s in by_path["restore"]],
        "restore_kinds": [s.start.get("kind") for s in by_path["restore"]],
        "restore_fallbacks": fallbacks,
        "ratio": restore / cold,
        "ratio_by_round": round_ratio,
        "phases_p50_s": phases,
        "restore_step_s": step,
        "restore_step_by_round_s": steps,
        "restore_gb_per_s": image["raw_bytes"] / step / 1e9 if steps else float("nan"),
        "page_cache_read_s": read,
        "page_cache_gb_per_s": image["raw_bytes"] / read / 1e9,
        "fresh_memory_read_s": fresh,
        "fresh_memory_gb_per_s": image["raw_bytes"] / fresh / 1e9,
        "step_over_read": step / read,
        "step_over_fresh_read": step / fresh,
        "restore_over_first_boot": restore / result["first_boot"]["seconds"],
        "step_over_read_by_round": [s / read for s in steps],
        # The first boot's answer is the reference the others must repeat exactly.
        "answers_identical": sum(a == result["reference_tokens"] for a in answers) + 1,
        "answers": len(answers) + 1,
    }


def verdicts(summary: dict[str, Any]) -> dict[str, bool]:
    # NaN (no restore measured) compares false: a miss, never a pass. A restore that
    # booted cold is a miss too: the restore path did not deliver that call.
    return {
        "restore_ratio_pass": summary["ratio"] <= REACH_RESTORE_RATIO
        and not summary["restore_fallbacks"],
        "page_cache_pass": summary["step_over_read"] <= REACH_PAGE_CACHE_RATIO,
        "answers_pass": summary["answers_identical"] == summary["answers"],
    }


def report(result: dict[str, Any]) -> str:
    setup, summary, verdict = result["setup"], result["summary"], result["verdicts"]
    model, image, first = setup["model"], result["image"], result["first_boot"]
    mb = 1e6
    lines = [
        f"cold start: examples/transformer, {model['parameters'] / 1e6:.0f} M parameters "
        f"({model['weight_bytes'] / mb:.0f} MB fp32), torch {model['torch']} with "
        f"{model['threads']} threads on {setup['cpus']} CPUs; {setup['rounds']} rounds "
        "alternating paths",
        f"  each call: generate, {len(setup['prompt_ids'])} prompt ids -> "
        f"{setup['max_new_tokens']} new tokens, from zero replicas (scale-down window "
        f"{setup['scaledown_window']:g} s)",
        "  cold boots: "
        + (
            "eager (--quick: TORCHDYNAMO_DISABLE=1, nothing compiled)"
            if not setup.get("compiled", True)
            else "Inductor's compile cache warm (an unmeasured first cold boot filled it)"
            if setup["compile_cache"]
            else "Inductor's caches off (every boot compiles afresh)"
        ),
        f"  first boot ({'empty compile cache' if setup.get('compiled', True) else 'eager'}, "
        f"then the dump): {first['seconds']:.2f} s to the answer, ready after "
        f"{first['start'].get('total_seconds', float('nan')):.2f} s; "
        f"import torch {model['import_seconds']:.1f} s, build {model['build_seconds']:.1f} s, "
        f"compile and warm {model['compile_seconds']:.1f} s",
        "",
        f"{'request -> answer (s)':26}{'cold':>10}{'restore':>10}{'restore/cold':>15}",
    ]
    cold_rounds, restore_rounds = summary["cold_by_round_s"], summary["restore_by_round_s"]
    for number, (c, r) in enumerate(zip(cold_rounds, restore_rounds, strict=True)):
        kind = summary["restore_kinds"][number]
        note = "" if kind == "restore" else f"  (booted {kind}: not counted)"
        lines.append(f"{f'  round {number + 1}':26}{c:>10.2f}{r:>10.2f}{r / c:>15.1%}{note}")
    lines.append(
        f"{'  p50':26}{summary['cold_p50_s']:>10.2f}{summary['restore_p50_s']:>10.2f}"
        f"{summary['ratio']:>15.1%}"
    )
    lines.append(
        f"{'  first boot':26}{first['seconds']:>10.2f}{'':>10}"
        f"{summary['restore_over_first_boot']:>15.1%}"
    )
    lines += ["", f"{'start phases, p50 (s)':26}{'cold':>10}{'restore':>10}"]
    phases = summary["phases_p50_s"]
    for phase in PHASES:
        values = [phases.get(p, {}).get(phase, float("nan")) for p in PATHS]
        lines.append(f"{'  ' + phase.replace('_', ' '):26}{values[0]:>10.3f}{values[1]:>10.3f}")
    lines.append("  (total: placement to ready; first input: its dispatch to its result;")
    lines.append("   memory in: from the restore step's start until a lazy restore's last page)")
    steps = ", ".join(f"{s:.3f}" for s in summary["restore_step_by_round_s"])
    lines += [
        "",
        f"image: {image['raw_bytes'] / mb:.0f} MB raw ({image['files']} files), "
        f"{image['compressed_bytes'] / mb:.0f} MB compressed in the blob store; dumped in "
        f"{image['dump_seconds']:.2f} s, published (packed and uploaded in the background) "
        f"{image['published_after_answer_seconds']:.1f} s after the first answer",
        f"restore step: {summary['restore_step_s']:.3f} s p50 [by round: {steps}] = "
        f"{summary['restore_gb_per_s']:.2f} GB/s of raw image; "
        + (
            "lazy: the replica runs while its memory arrives"
            if setup["lazy_restore"]
            else "eager: all memory copied before the replica runs"
        ),
        f"page-cache read of the image: {summary['page_cache_read_s']:.3f} s p50 of "
        f"{len(image['page_cache_read_seconds'])} = {summary['page_cache_gb_per_s']:.2f} GB/s; "
        f"into fresh memory{' (2 MiB pages)' if setup.get('huge_pages') else ''}: "
        f"{summary['fresh_memory_read_s']:.3f} s = "
        f"{summary['fresh_memory_gb_per_s']:.2f} GB/s (restore step "
        f"{summary['step_over_fresh_read']:.2f}x that)",
    ]
    if image.get("mapped_files"):
        lines.append(
            f"weights mapped from the node's cache, not in the image: "
            f"{image['mapped_bytes'] / mb:.0f} MB in {image['mapped_files']} file(s); "
            f"page-cache read of the image and them: {summary['with_mapped_read_s']:.3f} s "
            f"(restore step {summary['step_over_read_with_mapped']:.2f}x that)"
        )
    elif setup.get("weights_through_cache"):
        lines.append("warning: --weights, but the image maps no weights file (see the notes)")
    if summary["restore_fallbacks"]:
        lines.append(
            f"warning: {summary['restore_fallbacks']} restore(s) fell back to a cold boot "
            "(a miss for the restore path; see the log lines below)"
        )
    if result["notes"]:
        lines += ["", "platform log lines about snapshots and failures:"]
        lines += [f"  {note}" for note in result["notes"][-20:]]
    ratio_rounds = ", ".join(f"{x:.1%}" for x in summary["ratio_by_round"])
    read_rounds = ", ".join(f"{x:.2f}x" for x in summary["step_over_read_by_round"])
    lines += [
        "",
        f"restore path: {summary['ratio']:.1%} of the cold path "
        f"(reach <= {REACH_RESTORE_RATIO:.0%}): "
        f"{'PASS' if verdict['restore_ratio_pass'] else 'MISS'}   [by round: {ratio_rounds}]",
        f"restore step: {summary['step_over_read']:.2f}x the page-cache read "
        f"(reach <= {REACH_PAGE_CACHE_RATIO:g}x): "
        f"{'PASS' if verdict['page_cache_pass'] else 'MISS'}   [by round: {read_rounds}]",
        f"answers: {summary['answers_identical']} of {summary['answers']} the same tokens "
        f"{result['reference_tokens']} (cold and restored alike): "
        f"{'PASS' if verdict['answers_pass'] else 'MISS'}",
    ]
    return "\n".join(lines)


def partial_report(result: dict[str, Any]) -> str:
    """What a run that failed measured before, and where it failed."""
    lines = ["cold start: examples/transformer; the run failed part-way"]
    if "first_boot" in result:
        first = result["first_boot"]
        lines.append(
            f"  first boot (then the dump): {first['seconds']:.2f} s to the answer, ready after "
            f"{first['start'].get('total_seconds', float('nan')):.2f} s"
        )
    for sample in result.get("samples", ()):
        lines.append(
            f"  round {sample['round'] + 1}, {sample['path']}: {sample['seconds']:.2f} s "
            f"({sample['start'].get('kind')} start)"
        )
    failed = result["failed"]
    lines.append(f"FAILED in {failed['part']}: {failed['error']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/coldstart.py",
        description="Measure a cold start from zero replicas both ways: booted cold "
        "(import torch, build a ~430 MB transformer, torch.compile) and restored from a "
        "CRIU snapshot of a replica that did that. Starts `ember server` in a temporary "
        "state dir, deploys examples/transformer twice (snapshots on and off), and "
        "alternates the two paths in rounds, waiting for scale-to-zero before each call. "
        "Prints both times, their ratio, the start phases, the image's size, the restore "
        "step's GB/s and a page-cache read of the image, with verdicts against the reach "
        f"(restore path <= {REACH_RESTORE_RATIO:.0%} of the cold path, restore step <= "
        f"{REACH_PAGE_CACHE_RATIO:g}x the page-cache read). Needs root and CRIU (as "
        "`ember server` does for snapshots).",
        epilog="Exit status: 0 when every verdict passes, 1 when one misses, 2 on error (with "
        "--quick: 0 once every verdict is printed).",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="rounds, each one cold and one restored call; the order alternates (default: 3; "
        "--quick: 1)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help="new tokens per call, decoded greedily (default: 8; --quick: 2)",
    )
    parser.add_argument(
        "--scaledown",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="the endpoints' scale-down window: how long an idle replica lives (default: 2)",
    )
    parser.add_argument(
        "--read-repeats",
        type=int,
        metavar="N",
        help="timed page-cache reads of the image, after one warm read (default: 3; --quick: 1)",
    )
    parser.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="turn Inductor's caches off, so that every cold boot compiles from scratch as "
        "on a fresh node (default: cold boots reuse what an unmeasured first cold boot "
        "compiled; about "
        "3 minutes longer on 2 CPUs)",
    )
    parser.add_argument(
        "--lazy-restore",
        action="store_true",
        help="run `ember server --lazy-restore`: a restored replica runs while its memory "
        "arrives (default: eager restores, all memory copied first)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="run `ember server --huge-pages`: restores put the replica's dense memory in "
        "2 MiB pages, and the fresh-memory read does too (default: 4 KiB pages)",
    )
    parser.add_argument(
        "--weights",
        action="store_true",
        help="load the model's weights through `weights=` from a safetensors file (read "
        "through the node's weights cache) instead of building them: the restored "
        "replica's tensors stay mapped from that cache, out of the image (default: built "
        "in memory, so in the image)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one round of 2-token calls, one timed read, the model eager in the replicas "
        "(TORCHDYNAMO_DISABLE=1): every verdict printed, none judged by the exit status",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary state dir (logs, images)"
    )
    args = parser.parse_args(argv)
    for name, (full, quick) in {"rounds": (3, 1), "tokens": (8, 2), "read_repeats": (3, 1)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.rounds < 1 or args.tokens < 1 or args.read_repeats < 1 or args.scaledown < 0:
        parser.error("--rounds, --tokens and --read-repeats must be positive, --scaledown >= 0")
    if args.tokens > 100:
        parser.error("--tokens: at most 100 (the example's context is 128)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; the server and its processes are stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # what the parts before measured is printed all the same
        failed = result.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(exc).__name__}: {exc}"
    if "failed" in result:
        print(json.dumps(result, indent=2) if args.json else partial_report(result))
        failed = result["failed"]
        print(f"bench/coldstart.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    result["summary"] = summarize(result)
    result["verdicts"] = verdicts(result["summary"])
    print(json.dumps(result, indent=2) if args.json else report(result))
    if args.quick:  # one round: the verdicts are printed, not judged
        return 0
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
