"""GPU snapshot check: a CUDA graph captured before a snapshot replays after a restore.

One self-contained run on an NVIDIA machine (a few minutes at most, bounded at 285 s):

1. starts `ember server` in a temporary state dir (its own HOME and EMBER_CONFIG) and
   deploys an app written to a temporary folder: a class endpoint whose
   `enter(snap=True)` builds a small torch MLP on the GPU, captures a CUDA graph of it
   (static input and output buffers), replays it once and keeps that output on the host;
   its `replay` method copies a fixed input into the captured input buffer, replays the
   graph, and answers the output, its SHA-256 and whether it equals the snap-time output
   bit for bit;
2. calls it once: the first replica boots cold and the platform snapshots it at its
   quiet point (CUDA checkpoint, then the CRIU dump), then it serves;
3. waits until the endpoint has scaled to zero (scaledown_window=2);
4. calls it again: a new replica is restored from the snapshot (CRIU restore, then the
   CUDA restore) and replays the graph captured in the first process;
5. checks that `GET /v1/apps` reports the last start as a "restore", that both answers
   match the snap-time output and each other bit for bit, and prints cold versus restore
   times: request to answer, and the replica's start phases;
6. on a GPU, checks that `/metrics` carries the worker's NVML telemetry (power, memory).

Run it from the repository root, as root (CRIU needs it):

    bash infra/install.sh                       # once: Ember, CRIU and pycriu
    .venv/bin/pip install 'ember[gpu]'          # or: .venv/bin/pip install -e '.[gpu]'
    .venv/bin/python bench/gpu_snapshot_check.py [--keep]
    .venv/bin/python bench/gpu_snapshot_check.py --device cpu   # a dry run, no GPU

On a GPU machine that cannot reach a package index, bench/gpu_checks.sh sets up from a kit
packed by infra/device_kit.sh and runs this check.

It needs: an NVIDIA GPU with driver 570 or newer; cuda-bindings (the `gpu` extra) in
.venv for the worker's CUDA checkpoint calls; a CUDA build of torch in .venv; CRIU 4.1+
and pycriu (infra/install.sh). Output: PASS/FAIL lines; exit status 0 when every check
passes, 1 when one fails or a prerequisite is missing. On a machine without an NVIDIA GPU
it prints "skipped: no NVIDIA GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEADLINE_S = 285.0  # the whole run, prerequisites and cleanup included, stays under 5 min
STOP_GRACE_S = 15.0
APP_NAME = "gpusnap"
ENDPOINT = "graph"
LABEL = f"{APP_NAME}--{ENDPOINT}"

APP = '''\
"""A CUDA graph captured in enter(snap=True), replayed by a method."""

import hashlib
import os
import time

import ember

DEVICE = "cuda"  # "cpu" in a dry run: the same steps with no GPU and no graph
GPU = None  # the node's GPU type: a replica is shown the GPUs it asks for, and no other


def process_id() -> str:
    """This process told apart from every other: its start time since boot, in clock
    ticks. Not a PID: a replica is PID 1 of its own namespace, with a /proc of its own.
    A restored process is a new one, whatever memory it holds."""
    with open("/proc/self/stat") as stat:
        return stat.read().rpartition(")")[2].split()[19]  # field 22, starttime


def digest(tensor) -> str:
    """SHA-256 of the tensor's bytes as they are in memory: equal digests, equal bits."""
    import torch

    raw = bytes(tensor.contiguous().view(torch.uint8).flatten().tolist())
    return hashlib.sha256(raw).hexdigest()


@ember.endpoint(
    name="graph",
    min_replicas=0,
    max_replicas=1,
    concurrency=1,
    scaledown_window=2,
    timeout=120,
    memory=4096,
    gpu=GPU,
    snapshot=True,
)
class Graph:
    @ember.enter(snap=True)
    def capture(self) -> None:
        began = time.perf_counter()
        import torch

        self.imported_seconds = time.perf_counter() - began
        generator = torch.Generator().manual_seed(1234)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
        )
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        self.model = model.to(DEVICE).eval()
        self.fixed_input = torch.randn(8, 256, generator=generator)  # on the host
        self.static_input = self.fixed_input.to(DEVICE)
        self.device = "cpu"
        if DEVICE == "cpu":
            self.graph = None
            self.static_output = self.forward()
        else:
            self.capture_graph()
            self.device = torch.cuda.get_device_name()
        self.snap_output = self.static_output.detach().cpu().clone()
        self.snap_sha256 = digest(self.snap_output)
        self.snap_process = process_id()
        self.capture_seconds = time.perf_counter() - began

    def forward(self):
        import torch

        with torch.no_grad():
            return self.model(self.static_input)

    def capture_graph(self) -> None:
        import torch

        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
                for _ in range(3):
                    self.model(self.static_input)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_output = self.model(self.static_input)
        self.graph.replay()
        torch.cuda.synchronize()

    @ember.method
    def replay(self) -> dict:
        import torch

        self.static_input.copy_(self.fixed_input)
        if self.graph is None:
            self.static_output = self.forward()
        else:
            self.graph.replay()
            torch.cuda.synchronize()
        output = self.static_output.detach().cpu().clone()
        sha256 = digest(output)
        return {
            "output": output.flatten().tolist(),
            "sha256": sha256,
            "snap_sha256": self.snap_sha256,
            "matches_snap": sha256 == self.snap_sha256,
            "process": process_id(),
            "snap_process": self.snap_process,
            "device": self.device,
            "import_seconds": self.imported_seconds,
            "capture_seconds": self.capture_seconds,
        }
'''


class Failed(Exception):
    """A check failed or a step could not be done: printed as FAIL, exit status 1."""


class Run:
    def __init__(self, keep: bool) -> None:
        self.started = time.monotonic()
        self.keep = keep
        self.failures = 0
        self.server: subprocess.Popen[bytes] | None = None
        self.work = Path(tempfile.mkdtemp(prefix="ember-gpu-check-"))
        self.log = self.work / "server.log"
        self.url = ""
        self.token = ""
        self.context: ssl.SSLContext | None = None
        self.workers: list[dict[str, Any]] = []  # as GET /v1/apps last listed them

    # ----- output ----------------------------------------------------------------
    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'}: {what}" + (f" ({detail})" if detail else ""))
        if not ok:
            self.failures += 1
        return ok

    def left(self, wanted: float) -> float:
        """`wanted` seconds, or what is left of the run's deadline if less."""
        remaining = DEADLINE_S - (time.monotonic() - self.started) - STOP_GRACE_S
        if remaining <= 1:
            raise Failed(f"out of time: the run is bounded at {DEADLINE_S:.0f} s")
        return min(wanted, remaining)

    # ----- the server --------------------------------------------------------------
    def start_server(self, app_file: Path) -> None:
        state = self.work / "state"
        home = self.work / "home"
        home.mkdir()
        env = {
            **os.environ,
            "HOME": str(home),
            "EMBER_CONFIG": str(self.work / "config.json"),
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("EMBER_TOKEN", "EMBER_SERVER_URL", "EMBER_CA_CERT"):
            env.pop(name, None)
        command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
        command += ["--port", "0", "--deploy", str(app_file)]
        with self.log.open("wb") as handle:
            self.server = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.left(90)
        pattern = re.compile(rf"^\s+{re.escape(LABEL)}\s+(https://\S+)", re.MULTILINE)
        while True:
            text = self.log.read_text(errors="replace")
            served = re.search(r"^Ember is serving at (https://\S+)", text, re.MULTILINE)
            deployed = pattern.search(text)
            if served and deployed:
                self.url = deployed.group(1)
                break
            if self.server.poll() is not None:
                raise Failed(f"ember server exited with status {self.server.returncode}")
            if time.monotonic() > deadline:
                raise Failed("ember server did not deploy the app in time")
            time.sleep(0.1)
        self.token = (state / "admin-token").read_text().strip()
        self.context = ssl.create_default_context(cafile=str(state / "ca.pem"))

    def stop_server(self) -> None:
        """SIGTERM the server's session; the worker stops its replicas (their lifelines
        close too). Whatever of its tree is left after the grace is SIGKILLed by PID."""
        server = self.server
        if server is None or server.poll() is not None:
            return
        tree = _descendants(server.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=STOP_GRACE_S - 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        deadline = time.monotonic() + 5
        for pid, command in tree.items():
            while time.monotonic() < deadline and _alive(pid, command):
                time.sleep(0.05)
            if _alive(pid, command):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def tail(self, lines: int = 25) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # ----- HTTP ----------------------------------------------------------------------
    def request(
        self, method: str, url: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        parts = urlsplit(url)
        connection = http.client.HTTPSConnection(
            parts.hostname or "", parts.port, context=self.context, timeout=timeout
        )
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = {"Authorization": f"Bearer {self.token}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def endpoint(self) -> dict[str, Any]:
        base = self.url.split(f"/{LABEL}/")[0]
        status, body = self.request("GET", f"{base}/v1/apps", None, 10)
        if status != 200:
            raise Failed(f"GET /v1/apps answered {status}: {body[:300]!r}")
        data = json.loads(body)
        self.workers = data.get("workers", [])
        for row in data["endpoints"]:
            if row["label"] == LABEL:
                return dict(row)
        raise Failed(f"GET /v1/apps does not list {LABEL}")

    def app_logs(self, lines: int = 40) -> str:
        base = self.url.split(f"/{LABEL}/")[0]
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
            status, body = self.request(
                "GET", f"{base}/v1/apps/{APP_NAME}/logs?tail={lines}", None, 10
            )
            if status == 200:
                entries = [json.loads(line) for line in body.splitlines() if line.strip()]
                return "\n".join(
                    f"  [{e.get('stream')}] {e.get('text')}" for e in entries if e.get("text")
                )
        return "  (no logs)"

    def call(self) -> tuple[dict[str, Any], float]:
        """POST the replay method; (its answer, seconds from request to answer)."""
        began = time.perf_counter()
        status, body = self.request("POST", f"{self.url}replay", b"{}", self.left(150))
        elapsed = time.perf_counter() - began
        if status != 200:
            raise Failed(f"the call answered {status}: {body[:500]!r}\n{self.app_logs()}")
        return json.loads(body), elapsed

    def wait_for(self, what: str, predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + self.left(timeout)
        while True:
            row = self.endpoint()
            if predicate(row):
                return row
            if time.monotonic() > deadline:
                raise Failed(f"{what}: not within {timeout:g} s\n{self.app_logs()}")
            time.sleep(0.25)


def _descendants(root: int) -> dict[int, str]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = _cmdline(pid)
        todo.extend(children.get(pid, []))
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _alive(pid: int, command: str) -> bool:
    """The same process still runs: not a zombie, its PID not reused."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and _cmdline(pid) == command


def _has_nvidia_gpu() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


def _phases(start: dict[str, Any] | None) -> str:
    if not start:
        return "none reported"
    parts = [f"{k.removesuffix('_seconds')} {v:.3f} s" for k, v in start.items() if k != "kind"]
    return f"{start.get('kind')}: " + ", ".join(parts)


def prerequisites(run: Run, device: str) -> None:
    """What this check needs besides the GPU; each missing one is a FAIL."""
    from ember_worker.snapshots.cuda_checkpoint import MIN_DRIVER, REQUIREMENT, driver_version

    if os.geteuid() != 0:
        raise Failed("run as root: CRIU and PID namespaces need it")
    if device == "cpu":
        return
    version = driver_version()
    if version is None or version < MIN_DRIVER:
        found = f"{version[0]}.{version[1]}" if version else "unknown"
        raise Failed(f"NVIDIA driver {MIN_DRIVER[0]}+ is needed (found {found})")
    print(f"driver: NVIDIA {version[0]}.{version[1]}")
    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        raise Failed(f"cuda-bindings is not installed: .venv/bin/pip install '{REQUIREMENT}'")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, "
            "torch.cuda.is_available()]))",
        ],
        capture_output=True,
        text=True,
        timeout=run.left(90),
        check=False,
    )
    if probe.returncode != 0:
        raise Failed(f"torch does not import: {probe.stderr.strip()[-500:]}")
    torch_version, cuda_version, available = json.loads(probe.stdout.strip().splitlines()[-1])
    if not cuda_version or not available:
        raise Failed(
            f"torch {torch_version} is not a working CUDA build (torch.version.cuda="
            f"{cuda_version}, torch.cuda.is_available()={available})"
        )
    print(f"torch: {torch_version} (CUDA {cuda_version})")


def gpu_type() -> str:
    """The type of this machine's first GPU, as the worker offers it and endpoints ask."""
    from ember.declarations.settings import GPU_TYPES
    from ember_worker.resources import detect_gpus

    devices = detect_gpus()
    if not devices:
        raise Failed("nvidia-smi lists no GPU")
    kind = devices[0].kind
    if kind not in GPU_TYPES:
        raise Failed(f"this GPU ({kind}) is not a type endpoints can ask for: {GPU_TYPES}")
    print(f"GPU type: {kind} ({len(devices)} GPU(s) on this machine)")
    return kind


def gpu_telemetry(run: Run) -> None:
    """The worker's NVML samples reach /metrics (they come with its heartbeats)."""
    base = run.url.split(f"/{LABEL}/")[0]
    wanted = ("ember:gpu_power_watts", "ember:gpu_memory_total_bytes")
    found: dict[str, float] = {}
    deadline = time.monotonic() + run.left(30)
    while time.monotonic() < deadline:
        status, body = run.request("GET", f"{base}/metrics", None, 10)
        for line in body.decode(errors="replace").splitlines() if status == 200 else []:
            name, _, value = line.partition("{")
            if name in wanted and "}" in value:
                with contextlib.suppress(ValueError):
                    found[name] = float(value.rsplit("}", 1)[1])
        if all(found.get(name, 0) > 0 for name in wanted):
            break
        time.sleep(1)
    run.check(
        all(found.get(name, 0) > 0 for name in wanted),
        "/metrics has the worker's GPU telemetry (NVML)",
        ", ".join(f"{name} {found[name]:g}" for name in found) or "none of it",
    )


def check(run: Run, device: str) -> None:
    prerequisites(run, device)
    folder = run.work / "app"
    folder.mkdir()
    app_file = folder / f"{APP_NAME}.py"
    app = APP.replace('DEVICE = "cuda"', f'DEVICE = "{device}"', 1)
    if device == "cuda":
        app = app.replace("GPU = None", f"GPU = {gpu_type()!r}", 1)
    app_file.write_text(app)
    print("starting ember server and deploying the app ...", flush=True)
    run.start_server(app_file)
    run.endpoint()
    problems = [w["snapshots"].get("problem") for w in run.workers if w.get("snapshots")]
    if not run.workers or any(problems):
        raise Failed(f"snapshots are off on the worker: {problems or 'no worker registered'}")

    print("call 1: the first replica boots cold and is snapshotted ...", flush=True)
    cold, cold_seconds = run.call()
    row = run.wait_for("the snapshot", lambda r: bool(r.get("snapshots")), 60)
    cold_start = row.get("last_start") or {}
    snapshot = row["snapshots"][0]
    run.check(
        cold_start.get("kind") == "cold", "the first replica booted cold", _phases(cold_start)
    )
    run.check(
        cold["matches_snap"], "call 1 replayed the graph to the snap-time output, bit for bit"
    )

    print("waiting for scale-to-zero ...", flush=True)
    run.wait_for("scale to zero", lambda r: sum((r.get("replicas") or {}).values()) == 0, 60)

    print("call 2: a replica restored from the snapshot replays the graph ...", flush=True)
    restored, restore_seconds = run.call()
    row = run.endpoint()
    restore_start = row.get("last_start") or {}
    ok = run.check(
        restore_start.get("kind") == "restore",
        'GET /v1/apps reports last_start.kind == "restore"',
        _phases(restore_start),
    )
    run.check(
        restored["process"] != cold["process"] and restored["snap_process"] == cold["snap_process"],
        "call 2 ran in a new process holding the first one's captured graph",
        f"processes started at tick {cold['process']} -> {restored['process']}, "
        f"captured in {restored['snap_process']}",
    )
    run.check(
        restored["matches_snap"],
        "call 2 replayed the restored graph to the snap-time output, bit for bit",
    )
    run.check(
        restored["sha256"] == cold["sha256"] and restored["output"] == cold["output"],
        "outputs before and after the restore are identical",
        f"sha256 {cold['sha256'][:16]}… vs {restored['sha256'][:16]}…",
    )
    if not ok:
        print(run.app_logs())
    if device == "cuda":
        gpu_telemetry(run)

    print()
    print(f"device: {cold.get('device')}")
    print(
        f"snapshot: {snapshot.get('size', 0) / 1e6:.0f} MB compressed, "
        f"dumped in {snapshot.get('dump_seconds', 0.0):.2f} s"
    )
    print(
        f"cold:    request to answer {cold_seconds:7.3f} s  (includes the snapshot; replica "
        f"{_phases(cold_start)}; import torch {cold['import_seconds']:.2f} s, "
        f"model + graph capture {cold['capture_seconds'] - cold['import_seconds']:.2f} s)"
    )
    print(
        f"restore: request to answer {restore_seconds:7.3f} s  (replica {_phases(restore_start)})"
    )
    boot = float(cold_start.get("boot_seconds") or 0.0)
    restore_total = float(restore_start.get("total_seconds") or 0.0)
    if boot and restore_total:
        print(
            f"replica start: cold boot {boot:.3f} s vs restore {restore_total:.3f} s "
            f"({boot / restore_total:.1f}x)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a dry run of every step but the CUDA ones, on a machine without a GPU",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not _has_nvidia_gpu():
        print("skipped: no NVIDIA GPU")
        return 0
    run = Run(args.keep)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        check(run, args.device)
    except Failed as exc:
        run.check(False, str(exc))
    except KeyboardInterrupt:
        run.check(False, "interrupted")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, previous)
        if run.failures and run.server is not None:
            print(f"server log ({run.log}):\n{run.tail()}")
        run.stop_server()
        if args.keep:
            print(f"kept {run.work}")
        else:
            shutil.rmtree(run.work, ignore_errors=True)
    print(
        f"{'PASS' if not run.failures else 'FAIL'}: GPU snapshot check"
        f"{' (dry run on the CPU)' if args.device == 'cpu' else ''} "
        f"({time.monotonic() - run.started:.0f} s)"
    )
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
