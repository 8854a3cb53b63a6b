"""What lazy image roots gain: the first start on a node that never saw a large image,
lazy file system against full extraction, side by side in one run (issue 38).

The image: this machine's torch environment (the .venv's site-packages: torch 2.13 CPU
and what it needs, over 1 GB in some 20,000 files) as one layer under
/usr/local/lib/python3.11/dist-packages, and a layer with the app's file and a
python3.11 link. Its layers are stored in a real `ember server`'s store under the layer
digests of `Image.debian_slim().pip_install("torch==2.13.0")...` (built here as tars,
not by mmdebstrap and pip: that takes many minutes), its record written as a build
writes it, and its file index made as a build makes it.

A "node" is a fresh folder: its roots, disk cache, indexes. For each side, the first
start is the root made (`LazyImageRoots.root_for` mounting it; `ExtractedImageRoots`
fetching and unpacking every layer) and then the replica's work in that root: a new
Python that imports torch from the image and answers `torch.ones(4).sum()`. Bytes
fetched: what the store sent (the mount's counts and the index; the tars' sizes).
A second start on the same node (the mount up, the kernel's page cache warm) is
compared with the same work in today's default environment (the worker's own
site-packages, warm). An unchanged redeploy's build is `ImageBuilder.build` of the
image whose record is stored: one request.

Not measured here: a replica process in the sandbox on the image (replicas do not run
on images on this branch yet), so "placement to first answer" is root + import +
answer, without the agent's launch, which is alike for both sides.

Reach: lazy first start <= 30 % of full extraction's; a second start within 10 % of
the default environment's; an unchanged redeploy builds in < 1 s.

    .venv/bin/python bench/images.py        # a few minutes on 2 CPUs
    .venv/bin/python bench/images.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
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
from ember_worker.images.builder import ImageBuilder
from ember_worker.images.image_roots import ExtractedImageRoots
from ember_worker.images.layer_store import LayerStore
from ember_worker.images.lazy.image_indexes import ensure_index
from ember_worker.images.lazy.lazy_roots import LazyImageRoots

REACH_LAZY_SHARE = 0.30
REACH_SECOND = 0.10
REACH_REDEPLOY_S = 1.0
SITE = "usr/local/lib/python3.11/dist-packages"
IMAGE = ember.Image.debian_slim(python="3.11").pip_install("torch==2.13.0")
WORK = "import torch; print(float(torch.ones(4).sum()))"


def site_packages() -> Path:
    import torch  # the .venv's: the image's contents

    return Path(torch.__file__).resolve().parents[1]


def make_layers(folder: Path) -> list[Path]:
    """The big layer (site-packages) and a small one (the app, a python3.11 link)."""
    big = folder / "site.tar"
    with tarfile.open(big, "w", format=tarfile.PAX_FORMAT) as tar:
        source = site_packages()
        for path in sorted(source.iterdir()):
            if path.name in ("__pycache__",) or path.name.endswith(".pth"):
                continue
            tar.add(str(path), arcname=f"{SITE}/{path.name}")
    small = folder / "app.tar"
    with tarfile.open(small, "w", format=tarfile.PAX_FORMAT) as tar:
        link = tarfile.TarInfo("usr/bin/python3.11")
        link.type, link.linkname = tarfile.SYMTYPE, "/usr/bin/python3"
        tar.addfile(link)
        app = tarfile.TarInfo("srv/app.py")
        data = WORK.encode()
        app.size = len(data)
        tar.addfile(app, io.BytesIO(data))
    return [big, small]


def store_image(store: LayerStore, layers: list[Path]) -> None:
    entries = []
    for layer, archive in zip(IMAGE.layers, layers, strict=True):
        entry = store.put_layer(layer.digest, layer.step["kind"], archive)
        entries.append({"digest": layer.digest, **entry})
    store.put_record(
        IMAGE.digest,
        {
            "digest": IMAGE.digest,
            "layers": entries,
            "env": {},
            "workdir": "/srv",
            "steps": IMAGE.to_dict()["steps"],
        },
    )


def answer_in(root: Path) -> float:
    """A new Python importing torch from `root`'s site-packages: seconds to its answer."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(root)!r}); {WORK}"],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0 or done.stdout.strip() != "4.0":
        raise RuntimeError(f"the work failed in {root}: {done.stderr[-2000:]}")
    return seconds


def first_start(roots: Any) -> tuple[float, float, Path]:
    started = time.perf_counter()
    root = asyncio.run(roots.root_for(IMAGE))
    made = time.perf_counter() - started
    answer = answer_in(root / SITE)
    return made, answer, root


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
        env = isolated_env(work)
        state = work / "state"
        command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
        server = ServerProcess.start(
            "ember server", [*command, "--port", "0"], work / "server.log", env
        )
        started.append(server)
        url = server_url(server, 60)
        ca = str(state / "ca.pem")
        admin = (state / "admin-token").read_text().strip()
        with httpx.Client(verify=client_context(ca), timeout=60) as client:
            made = client.post(
                f"{url}/v1/tokens",
                json={"scope": "worker", "name": "bench"},
                headers={"Authorization": f"Bearer {admin}"},
            ).raise_for_status()
        store = LayerStore(url, made.json()["token"], ca)

        progress(quiet, "packing the image's layers (the .venv's site-packages)")
        layers = make_layers(work)
        sizes = [path.stat().st_size for path in layers]
        progress(quiet, f"storing {sum(sizes) / 1e9:.2f} GB of layers")
        store_image(store, layers)
        for path in layers:
            path.unlink()
        began = time.perf_counter()
        index, _ = ensure_index(store, IMAGE.digest, work / "build-node" / "indexes")
        report["index"] = {
            "seconds": time.perf_counter() - began,
            "inodes": len(index.inodes),
            "file_bytes": index.file_bytes(),
        }

        progress(quiet, "an unchanged redeploy's build")
        builder = ImageBuilder(store, work / "build-node" / "builder")
        builds = []
        for _ in range(5):
            began = time.perf_counter()
            builder.build(IMAGE, lambda line: None)
            builds.append(time.perf_counter() - began)
        report["redeploy_build_s"] = statistics.median(builds)

        progress(quiet, "first start, full extraction, on a fresh node")
        extracted = ExtractedImageRoots(store, work / "node-full")
        full_made, full_answer, _ = first_start(extracted)
        report["full"] = {
            "root_s": full_made,
            "answer_s": full_answer,
            "total_s": full_made + full_answer,
            "bytes_fetched": sum(sizes),
        }

        progress(quiet, "first start, lazy file system, on another fresh node")
        lazy = LazyImageRoots(store, work / "node-lazy", ca)
        try:
            lazy_made, lazy_answer, root = first_start(lazy)
            how = lazy.how(IMAGE)
            if how["root"] != "lazy":
                raise RuntimeError(f"the lazy root was not used: {how}")
            time.sleep(0.5)  # the mount writes its counts every 0.2 s
            stats = lazy.stats(IMAGE)
            index_bytes = sum(
                p.stat().st_size for p in (work / "node-lazy").glob("image-indexes/*")
            )
            report["lazy"] = {
                "root_s": lazy_made,
                "answer_s": lazy_answer,
                "total_s": lazy_made + lazy_answer,
                "bytes_fetched": int(stats.get("origin_bytes", 0)) + index_bytes,
                "store_requests": int(stats.get("origin_requests", 0)),
            }

            progress(quiet, "second starts: lazy root (warm) and the default environment")
            second, default = [], []
            for _ in range(args.rounds):
                second.append(answer_in(root / SITE))
                default.append(answer_in(site_packages()))
            report["second"] = {
                "lazy_s": statistics.median(second),
                "default_s": statistics.median(default),
            }
        finally:
            lazy.close()
        store.close()
        shutil.rmtree(work / "node-full", ignore_errors=True)

    share = report["lazy"]["total_s"] / report["full"]["total_s"]
    second_ratio = report["second"]["lazy_s"] / report["second"]["default_s"]
    report["within_reach"] = {
        "lazy_first_start": share <= REACH_LAZY_SHARE,
        "second_start": second_ratio <= 1 + REACH_SECOND,
        "redeploy_build": report["redeploy_build_s"] < REACH_REDEPLOY_S,
    }
    report["ratios"] = {"lazy_over_full": share, "second_over_default": second_ratio}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    full, lazy_row = report["full"], report["lazy"]
    print(
        f"image: {sum(sizes) / 1e9:.2f} GB of layers, {report['index']['inodes']} inodes; "
        f"its index made in {report['index']['seconds']:.1f} s (once, at the build)"
    )
    print(f"{'first start on a fresh node':32}{'lazy':>10}{'full':>10}{'ratio':>8}")
    for key, name in (
        ("root_s", "root ready"),
        ("answer_s", "import + answer"),
        ("total_s", "total"),
    ):
        print(
            f"  {name:30}{lazy_row[key]:>9.2f}s{full[key]:>9.2f}s{lazy_row[key] / full[key]:>8.2f}"
        )
    fetched = lazy_row["bytes_fetched"], full["bytes_fetched"]
    print(
        f"  {'bytes fetched':30}{fetched[0] / 1e6:>8.0f}MB"
        f"{fetched[1] / 1e6:>8.0f}MB{fetched[0] / fetched[1]:>8.2f}"
    )
    second = report["second"]
    print(
        f"second start, same node: lazy {second['lazy_s']:.2f} s, default environment "
        f"{second['default_s']:.2f} s, ratio {second_ratio:.2f}"
    )
    print(f"unchanged redeploy's build: {report['redeploy_build_s'] * 1000:.0f} ms")

    def verdict(ok: bool) -> str:
        return "pass" if ok else "miss"

    reach = report["within_reach"]
    print(f"lazy first start <= 30 % of full: {verdict(reach['lazy_first_start'])} ({share:.0%})")
    print(f"second start within 10 % of default: {verdict(reach['second_start'])}")
    print(f"unchanged redeploy builds in < 1 s: {verdict(reach['redeploy_build'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
