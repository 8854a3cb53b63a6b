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
    .venv/bin/python bench/images.py --quick  # a small image: the .venv's packaging

With --quick the pip layer holds only the .venv's `packaging` (the image
`pip_install("packaging==VERSION")`, its app imports it and answers from it) and one
round of second starts: every part in seconds, at a size too small to judge a reach.
A run that fails part-way prints what the parts before measured, and which part failed.
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
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
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
ZERO_TIMEOUT_S = 120.0
APP = """
import sys

import ember

image = ember.Image.debian_slim(python="3.11").pip_install({requirement!r})


@ember.endpoint({image}scaledown_window=1, max_replicas=1, timeout=600)
class Torch:
    @ember.enter(snap=True)
    def load(self) -> None:
        import {imported}

        self.module = {module}

    @ember.method
    def answer(self) -> dict:
        return {{"sum": {answer}, "module": self.module.__file__, "python": sys.executable}}
"""


@dataclass(frozen=True)
class Package:
    """What the image's pip layer holds, and how its app proves the layer's code ran."""

    module: str  # imported by the app's enter hook; its file must be the image's
    requirement: str  # the image's pip_install step
    imported: str  # the import statement's target
    answer: str  # an expression of self.module that is 4.0
    whole_site: bool  # the .venv's whole site-packages, or the package's folder alone

    @property
    def image(self) -> ember.Image:
        return ember.Image.debian_slim(python="3.11").pip_install(self.requirement)

    def app(self, image: bool) -> str:
        return APP.format(
            requirement=self.requirement,
            image="image=image, " if image else "",
            imported=self.imported,
            module=self.module,
            answer=self.answer,
        )


TORCH = Package(
    "torch", "torch==2.13.0", "torch", "float(self.module.ones(4).sum())", whole_site=True
)
# --quick: a small pure-Python package, so that packing, storing and extracting the
# layers take seconds.
PACKAGING = Package(
    "packaging",
    f"packaging=={metadata.version('packaging')}",
    "packaging.version",
    "float(self.module.version.Version('4.0').major)",
    whole_site=False,
)


def site_packages() -> Path:
    import torch  # the .venv's: the image's pip layer

    return Path(torch.__file__).resolve().parents[1]


def make_layers(folder: Path, package: Package) -> list[Path]:
    """The base (python3.11, its libraries) and the pip layer (site-packages, or the
    package's folder alone)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from small_images import host_python_layer  # type: ignore[import-not-found]

    base = folder / host_python_layer(folder)
    site = folder / "site.tar"
    with tarfile.open(site, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(site_packages().iterdir()):
            if path.name == "__pycache__" or path.name.endswith(".pth"):
                continue  # the .venv's own: editable installs of Ember
            if not package.whole_site and path.name != package.module:
                continue
            tar.add(str(path), arcname=f"{SITE}/{path.name}")
        marker = tarfile.TarInfo(f"{SITE}/ember_bench_image.txt")
        marker.size = 2
        tar.addfile(marker, io.BytesIO(b"1\n"))
    return [base, site]


class Node:
    """One `ember server` (its local worker a fresh node) with the image stored."""

    def __init__(
        self, work: Path, extracted: bool, package: Package, started: list[ServerProcess]
    ) -> None:
        self.package = package
        self.image = package.image
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
        for layer, archive in zip(self.image.layers, layers, strict=True):
            entry = self.store.put_layer(layer.digest, layer.step["kind"], archive)
            entries.append({"digest": layer.digest, **entry})
        record = {"digest": self.image.digest, "layers": entries, "env": {}, "workdir": "/"}
        steps = self.image.to_dict()["steps"]
        self.store.put_record(self.image.digest, {**record, "steps": steps})

    def deploy(self, name: str, image: bool) -> float:
        source = self.work / name / "app.py"
        source.parent.mkdir(exist_ok=True)
        source.write_text(self.package.app(image))
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
        found = list(self.state.rglob(f"image-mounts/{self.image.digest[7:]}.stats"))
        return json.loads(found[0].read_text()) if found else {}

    def index_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.state.rglob("image-indexes/*.zst"))


def first_start(node: Node, name: str) -> dict[str, Any]:
    seconds, answer = node.call(name)
    module = node.package.module
    if not answer["module"].startswith(f"/{SITE}/{module}"):
        raise RuntimeError(f"{module} came from {answer['module']}, not the image")
    return {"seconds": seconds, "start": node.last_start(name)}


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fills `report` part by part; report["failed"] names the part a failure happens in."""
    quiet = args.quiet or args.json
    package = PACKAGING if args.quick else TORCH

    def part(name: str, message: str) -> None:
        report["failed"] = {"part": name, "error": ""}  # until the run ends
        progress(quiet, message)

    with (
        tempfile.TemporaryDirectory(prefix="ember-bench-images-") as scratch,
        stopped_at_exit() as started,
    ):
        work = Path(scratch)
        part("packing", f"packing the image's layers (python3.11, {package.requirement})")
        layers = make_layers(work, package)
        sizes = [path.stat().st_size for path in layers]
        report["image"] = {"requirement": package.requirement, "layer_bytes": sum(sizes)}

        part("full extraction", "full extraction: a node, the image stored, its app deployed")
        full = Node(work / "full", True, package, started)
        full.store_image(layers)
        full.deploy("full", image=True)
        progress(quiet, "full extraction: the first start")
        report["full"] = first_start(full, "full")
        report["full"]["bytes_fetched"] = sum(sizes)
        full.server.stop()
        full.client.close()

        part("lazy first start", "lazy: a node, the image stored and indexed, its app deployed")
        lazy = Node(work / "lazy", False, package, started)
        lazy.store_image(layers)
        for path in layers:
            path.unlink()
        began = time.perf_counter()  # what the building node does after a build
        index, _ = ensure_index(lazy.store, lazy.image.digest, work / "build-node")
        report["image"].update(
            index_seconds=time.perf_counter() - began,
            inodes=len(index.inodes),
            file_bytes=index.file_bytes(),
        )
        lazy.deploy("lazy", image=True)
        lazy.deploy("default", image=False)
        progress(quiet, "lazy: the first start")
        lazy_start = first_start(lazy, "lazy")
        time.sleep(0.5)  # the mount writes its counts every 0.2 s
        stats = lazy.mount_stats()
        lazy_start["bytes_fetched"] = stats.get("origin_bytes", 0) + lazy.index_bytes()
        lazy_start["store_requests"] = stats.get("origin_requests", 0)
        if lazy_start["start"].get("image_root") != "lazy":
            raise RuntimeError(f"not a lazy root: {lazy_start['start']}")
        report["lazy"] = lazy_start

        part("second starts", "second starts on the node: the image's app and the default one")
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

        part("redeploy", "an unchanged redeploy")
        checks = []
        for _ in range(5):
            began = time.perf_counter()
            built = lazy.client.get(f"/v1/image-builds/{lazy.image.digest}").raise_for_status()
            checks.append(time.perf_counter() - began)
            if not built.json().get("built"):
                raise RuntimeError(f"the image is not built: {built.text}")
        report["redeploy"] = {
            "build_s": statistics.median(checks),
            "deploy_s": lazy.deploy("lazy", image=True),
        }
        lazy.store.close()
        lazy.client.close()
        del report["failed"]


def judge(report: dict[str, Any]) -> None:
    """The ratios and verdicts of the parts that ran."""
    ratios: dict[str, float] = {}
    reach: dict[str, bool] = {}
    if "lazy" in report:
        ratios["lazy_over_full"] = report["lazy"]["seconds"] / report["full"]["seconds"]
        reach["lazy_first_start"] = ratios["lazy_over_full"] <= REACH_LAZY_SHARE
    if "second" in report:
        ratios["second_over_default"] = report["second"]["lazy"] / report["second"]["default"]
        reach["second_start"] = ratios["second_over_default"] <= 1 + REACH_SECOND
    if "redeploy" in report:
        reach["redeploy_build"] = report["redeploy"]["build_s"] < REACH_REDEPLOY_S
    report["ratios"] = ratios
    report["within_reach"] = reach


def show(report: dict[str, Any], rounds: int) -> None:
    def verdict(ok: bool) -> str:
        return "pass" if ok else "miss"

    image, reach, ratios = report.get("image"), report["within_reach"], report["ratios"]
    if image and "inodes" in image:
        print(
            f"image: {image['layer_bytes'] / 1e9:.2f} GB of layers ({image['requirement']}), "
            f"{image['inodes']} inodes; its file index made in {image['index_seconds']:.1f} s "
            "(once, after the build)"
        )
    if "lazy" in report:
        share = ratios["lazy_over_full"]
        print(f"{'first start on a fresh node':34}{'lazy':>10}{'full':>10}{'ratio':>8}")
        full_s, lazy_s = report["full"]["seconds"], report["lazy"]["seconds"]
        print(f"  {'placement to first answer':32}{lazy_s:>9.2f}s{full_s:>9.2f}s{share:>8.2f}")
        fetched = report["lazy"]["bytes_fetched"], report["full"]["bytes_fetched"]
        print(
            f"  {'bytes fetched from the store':32}{fetched[0] / 1e6:>8.0f}MB"
            f"{fetched[1] / 1e6:>8.0f}MB{fetched[0] / fetched[1]:>8.2f}"
        )
    elif "full" in report:
        print(f"first start on a fresh node, full extraction: {report['full']['seconds']:.2f} s")
    if "second" in report:
        second = report["second"]
        print(
            f"second start on the node (median of {rounds}): lazy root "
            f"{second['lazy']:.2f} s, default environment {second['default']:.2f} s, "
            f"ratio {ratios['second_over_default']:.2f}"
        )
    if "redeploy" in report:
        redeploy = report["redeploy"]
        print(
            f"unchanged redeploy: build {redeploy['build_s'] * 1000:.0f} ms "
            f"(the whole ember deploy {redeploy['deploy_s']:.2f} s)"
        )
    if "lazy_first_start" in reach:
        print(
            f"lazy first start <= 30 % of full: {verdict(reach['lazy_first_start'])} "
            f"({ratios['lazy_over_full']:.0%})"
        )
    if "second_start" in reach:
        print(f"second start within 10 % of default: {verdict(reach['second_start'])}")
    if "redeploy_build" in reach:
        print(f"unchanged redeploy builds in < 1 s: {verdict(reach['redeploy_build'])}")
    if "failed" in report:
        print(f"FAILED in {report['failed']['part']}: {report['failed']['error']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 when every part ran (the verdicts say pass or miss), 2 when "
        "one failed.",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--rounds", type=int, help="second starts of each kind (3; quick 1)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small image (the .venv's packaging for its pip layer) and one round",
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    report: dict[str, Any] = {}
    try:
        run(args, report)
    except KeyboardInterrupt:
        print("interrupted; the servers and their processes are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # what the parts before measured is printed all the same
        failed = report.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(error).__name__}: {error}"
    judge(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        show(report, args.rounds)
    if "failed" in report:
        failed = report["failed"]
        print(f"bench/images.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
