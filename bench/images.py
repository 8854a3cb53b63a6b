"""What lazy image roots gain: a replica of a large image starting on a node that never
saw it, lazy file system against full extraction, side by side in one run (issue 38).

The image, `Image.debian_slim(python="3.11").pip_install("torch==2.13.0")`, made here
rather than by mmdebstrap and pip (many minutes): its base layer is this node's Debian
python3.11 with its stdlib and the shared libraries it loads (tests/small_images.py),
its pip layer this machine's torch environment (the .venv's site-packages: torch 2.13
CPU and the rest, under /usr/local/lib/python3.11/dist-packages), about 2 GB in 80,000
files. Its layers, record and file index are stored as a build on a node stores them.

Two `ember server`s, each a fresh node: one with lazy roots (the default), one told to
extract (`EMBER_IMAGE_ROOTS=extracted`). On each, an app on the image (its enter hook
imports torch; it answers torch.ones(4).sum()) is deployed and called: placement to
first answer (the call's time from zero replicas: the root made, the replica's boot,
its snapshot's dump, its answer), and the bytes the node fetched from the store (the
mount's counts and the index; the layer tars' sizes). Then, on the lazy node, second
starts (replicas restored from the snapshot, the root mounted, the page cache warm)
alternate with those of the same app without image= (today's default environment: the
worker's Python and site-packages; restored too). snapshot=False would compare cold
boots, but replicas of images do not start as their user without a snapshot yet (the
sandbox's /ember/runtime/packages cannot be listed but by root). Last, an unchanged
redeploy: the image check `ember deploy` makes before anything (GET
/v1/image-builds/DIGEST: built already, nothing to build).

Reach: lazy first answer <= 30 % of full extraction's; a second start on the node
within 10 % of the default environment's; an unchanged redeploy's build < 1 s.

    .venv/bin/python bench/images.py        # about 6 minutes on 2 CPUs
    .venv/bin/python bench/images.py --json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from procs import ServerProcess, isolated_env, progress, server_url, stopped_at_exit

import ember
from ember.calling.tlsclient import client_context
from ember_worker.images.layer_store import LayerStore
from ember_worker.images.lazy.image_indexes import ensure_index

REACH_LAZY_SHARE = 0.30
REACH_SECOND = 0.10
REACH_REDEPLOY_S = 1.0
SITE = "usr/local/lib/python3.11/dist-packages"
IMAGE = ember.Image.debian_slim(python="3.11").pip_install("torch==2.13.0")
ZERO_TIMEOUT_S = 120.0
APP = """
import sys

import ember

image = ember.Image.debian_slim(python="3.11").pip_install("torch==2.13.0")


@ember.endpoint({image}scaledown_window=1, max_replicas=1, timeout=600)
class Torch:
    @ember.enter(snap=True)
    def load(self) -> None:
        import torch

        self.torch = torch

    @ember.method
    def answer(self) -> dict:
        return {{"sum": float(self.torch.ones(4).sum()), "torch": self.torch.__file__,
                "python": sys.executable}}
"""


def site_packages() -> Path:
    import torch  # the .venv's: the image's pip layer

    return Path(torch.__file__).resolve().parents[1]


def make_layers(folder: Path) -> list[Path]:
    """The base (python3.11, its libraries) and the pip layer (site-packages)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from small_images import host_python_layer  # type: ignore[import-not-found]

    base = folder / host_python_layer(folder)
    site = folder / "site.tar"
    with tarfile.open(site, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(site_packages().iterdir()):
            if path.name == "__pycache__" or path.name.endswith(".pth"):
                continue  # the .venv's own: editable installs of Ember
            tar.add(str(path), arcname=f"{SITE}/{path.name}")
        marker = tarfile.TarInfo(f"{SITE}/ember_bench_image.txt")
        marker.size = 2
        tar.addfile(marker, io.BytesIO(b"1\n"))
    return [base, site]


class Node:
    """One `ember server` (its local worker a fresh node) with the image stored."""

    def __init__(self, work: Path, extracted: bool, started: list[ServerProcess]) -> None:
        extra = {"EMBER_IMAGE_ROOTS": "extracted"} if extracted else {}
        work.mkdir()
        self.env = isolated_env(work, **extra)
        self.state = work / "state"
        command = [sys.executable, "-m", "ember.cli.main", "server"]
        command += ["--state-dir", str(self.state), "--port", "0"]
        self.server = ServerProcess.start("ember server", command, work / "server.log", self.env)
        started.append(self.server)
        self.url = server_url(self.server, 60)
        self.ca = str(self.state / "ca.pem")
        admin = (self.state / "admin-token").read_text().strip()
        self.client = httpx.Client(
            base_url=self.url,
            verify=client_context(self.ca),
            headers={"Authorization": f"Bearer {admin}"},
            timeout=900,
        )
        made = self.client.post("/v1/tokens", json={"scope": "worker", "name": "bench"})
        self.store = LayerStore(self.url, made.raise_for_status().json()["token"], self.ca)
        self.work = work

    def store_image(self, layers: list[Path]) -> None:
        entries = []
        for layer, archive in zip(IMAGE.layers, layers, strict=True):
            entry = self.store.put_layer(layer.digest, layer.step["kind"], archive)
            entries.append({"digest": layer.digest, **entry})
        record = {"digest": IMAGE.digest, "layers": entries, "env": {}, "workdir": "/"}
        self.store.put_record(IMAGE.digest, {**record, "steps": IMAGE.to_dict()["steps"]})

    def deploy(self, name: str, image: bool) -> float:
        source = self.work / name / "app.py"
        source.parent.mkdir(exist_ok=True)
        source.write_text(APP.format(image="image=image, " if image else ""))
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ember.cli.main", "deploy", str(source), "--name", name],
            env=self.env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"deploy {name}: {done.stderr}")
        return time.perf_counter() - began

    def call(self, name: str) -> tuple[float, dict[str, Any]]:
        began = time.perf_counter()
        answer = self.client.post(f"/{name}--torch/answer", json={})
        seconds = time.perf_counter() - began
        if answer.status_code != 200 or answer.json().get("sum") != 4.0:
            logs = subprocess.run(
                [sys.executable, "-m", "ember.cli.main", "logs", name],
                env=self.env,
                capture_output=True,
                text=True,
            )
            raise RuntimeError(
                f"{name}: HTTP {answer.status_code} {answer.text[:500]}\n{logs.stdout[-3000:]}"
            )
        return seconds, answer.json()

    def last_start(self, name: str) -> dict[str, Any]:
        rows = self.client.get("/v1/apps").raise_for_status().json()["endpoints"]
        return next(r for r in rows if r["label"] == f"{name}--torch").get("last_start") or {}

    def wait_for_zero(self) -> None:
        deadline = time.monotonic() + ZERO_TIMEOUT_S
        while True:
            self.server.remember()
            rows = self.client.get("/v1/apps").raise_for_status().json()["endpoints"]
            if not any(any(r["replicas"].values()) for r in rows):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not scale to zero")
            time.sleep(0.1)

    def wait_for_snapshots(self) -> None:
        deadline = time.monotonic() + 300
        while True:
            rows = self.client.get("/v1/apps").raise_for_status().json()["endpoints"]
            if all(r.get("snapshots") for r in rows):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no snapshots: {rows}")
            time.sleep(0.2)

    def mount_stats(self) -> dict[str, int]:
        found = list(self.state.rglob(f"image-mounts/{IMAGE.digest[7:]}.stats"))
        return json.loads(found[0].read_text()) if found else {}

    def index_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.state.rglob("image-indexes/*.zst"))


def first_start(node: Node, name: str) -> dict[str, Any]:
    seconds, answer = node.call(name)
    if not answer["torch"].startswith(f"/{SITE}/torch"):
        raise RuntimeError(f"torch came from {answer['torch']}, not the image")
    return {"seconds": seconds, "start": node.last_start(name)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="second starts of each kind")
    args = parser.parse_args()
    quiet = args.quiet or args.json
    report: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="ember-bench-images-") as scratch,
        stopped_at_exit() as started,
    ):
        work = Path(scratch)
        progress(quiet, "packing the image's layers (python3.11, the .venv's site-packages)")
        layers = make_layers(work)
        sizes = [path.stat().st_size for path in layers]
        report["image"] = {"layer_bytes": sum(sizes)}

        progress(quiet, "full extraction: a node, the image stored, its app deployed")
        full = Node(work / "full", True, started)
        full.store_image(layers)
        full.deploy("full", image=True)
        progress(quiet, "full extraction: the first start")
        report["full"] = first_start(full, "full")
        report["full"]["bytes_fetched"] = sum(sizes)
        full.server.stop()
        full.client.close()

        progress(quiet, "lazy: a node, the image stored and indexed, its app deployed")
        lazy = Node(work / "lazy", False, started)
        lazy.store_image(layers)
        for path in layers:
            path.unlink()
        began = time.perf_counter()  # what the building node does after a build
        index, _ = ensure_index(lazy.store, IMAGE.digest, work / "build-node")
        report["image"].update(
            index_seconds=time.perf_counter() - began,
            inodes=len(index.inodes),
            file_bytes=index.file_bytes(),
        )
        lazy.deploy("lazy", image=True)
        lazy.deploy("default", image=False)
        progress(quiet, "lazy: the first start")
        report["lazy"] = first_start(lazy, "lazy")
        time.sleep(0.5)  # the mount writes its counts every 0.2 s
        stats = lazy.mount_stats()
        report["lazy"]["bytes_fetched"] = stats.get("origin_bytes", 0) + lazy.index_bytes()
        report["lazy"]["store_requests"] = stats.get("origin_requests", 0)
        if report["lazy"]["start"].get("image_root") != "lazy":
            raise RuntimeError(f"not a lazy root: {report['lazy']['start']}")

        progress(quiet, "second starts on the node: the image's app and the default one")
        lazy.wait_for_zero()
        lazy.call("default")  # its first start (the worker's Python: warm already)
        lazy.wait_for_snapshots()
        second: dict[str, list[float]] = {"lazy": [], "default": []}
        for round_number in range(args.rounds):
            order = ("lazy", "default") if round_number % 2 == 0 else ("default", "lazy")
            for name in order:
                lazy.wait_for_zero()
                second[name].append(lazy.call(name)[0])
        report["second"] = {name: statistics.median(times) for name, times in second.items()}
        report["second"]["rounds"] = second

        progress(quiet, "an unchanged redeploy")
        checks = []
        for _ in range(5):
            began = time.perf_counter()
            built = lazy.client.get(f"/v1/image-builds/{IMAGE.digest}").raise_for_status()
            checks.append(time.perf_counter() - began)
            if not built.json().get("built"):
                raise RuntimeError(f"the image is not built: {built.text}")
        report["redeploy"] = {
            "build_s": statistics.median(checks),
            "deploy_s": lazy.deploy("lazy", image=True),
        }
        lazy.store.close()
        lazy.client.close()

    share = report["lazy"]["seconds"] / report["full"]["seconds"]
    second_ratio = report["second"]["lazy"] / report["second"]["default"]
    report["ratios"] = {"lazy_over_full": share, "second_over_default": second_ratio}
    report["within_reach"] = {
        "lazy_first_start": share <= REACH_LAZY_SHARE,
        "second_start": second_ratio <= 1 + REACH_SECOND,
        "redeploy_build": report["redeploy"]["build_s"] < REACH_REDEPLOY_S,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    image = report["image"]
    print(
        f"image: {image['layer_bytes'] / 1e9:.2f} GB of layers, {image['inodes']} inodes; "
        f"its file index made in {image['index_seconds']:.1f} s (once, after the build)"
    )
    print(f"{'first start on a fresh node':34}{'lazy':>10}{'full':>10}{'ratio':>8}")
    full_s, lazy_s = report["full"]["seconds"], report["lazy"]["seconds"]
    print(f"  {'placement to first answer':32}{lazy_s:>9.2f}s{full_s:>9.2f}s{share:>8.2f}")
    fetched = report["lazy"]["bytes_fetched"], report["full"]["bytes_fetched"]
    print(
        f"  {'bytes fetched from the store':32}{fetched[0] / 1e6:>8.0f}MB"
        f"{fetched[1] / 1e6:>8.0f}MB{fetched[0] / fetched[1]:>8.2f}"
    )
    second = report["second"]
    print(
        f"second start on the node (median of {args.rounds}): lazy root "
        f"{second['lazy']:.2f} s, default environment {second['default']:.2f} s, "
        f"ratio {second_ratio:.2f}"
    )
    redeploy = report["redeploy"]
    print(
        f"unchanged redeploy: build {redeploy['build_s'] * 1000:.0f} ms "
        f"(the whole ember deploy {redeploy['deploy_s']:.2f} s)"
    )

    def verdict(ok: bool) -> str:
        return "pass" if ok else "miss"

    reach = report["within_reach"]
    print(f"lazy first start <= 30 % of full: {verdict(reach['lazy_first_start'])} ({share:.0%})")
    print(f"second start within 10 % of default: {verdict(reach['second_start'])}")
    print(f"unchanged redeploy builds in < 1 s: {verdict(reach['redeploy_build'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
