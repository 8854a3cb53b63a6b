"""Weights through Ember's tiered cache against the plain ways to load a safetensors file.

A generated ~1 GB safetensors file is served over loopback by moto's S3 API (in its own
process) and by nginx (Debian's package, unpacked into a cache folder, not installed).
Each trial runs in a fresh Python process, so no trial finds another's memory; trials
of the compared paths alternate in rounds. Reported, with verdicts against the reach:

  (a) cold node cache: every tensor in memory through `ember.weights.open(s3://...)`
      versus boto3's `download_file` then `safetensors.torch.load_file`   (>= 2x faster)
  (b) warm node cache (a new process, the disk tier filled) versus `load_file` of a
      local file                                                          (<= 1.2x)
  (c) the first tensor versus the whole load, cold, over nginx             (< 5 %)
      (over S3 too, for information: moto reads the whole object for each ranged GET)

    .venv/bin/python bench/weights.py             # about 3 minutes on 2 CPUs
    .venv/bin/python bench/weights.py --quick     # a 0.12 GB file, one round
    .venv/bin/python bench/weights.py --json

Exit status: 0 when every verdict passes (with --quick: once every verdict is printed,
whatever it says: the reach is for a real checkpoint's size), 1 when one misses, 2 when a
part fails (what was measured before it is printed first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from procs import Parts, progress

REACH_COLD_SPEEDUP = 2.0
REACH_WARM_RATIO = 1.2
REACH_FIRST_TENSOR = 0.05
BUCKET = "bench"
KEY = "model.safetensors"
NGINX_CACHE = Path("/var/cache/ember/nginx")
TRIAL_TIMEOUT_S = 600.0
PATHS = ("ember_cold", "boto3_then_load_file", "ember_warm", "load_file_local", "ember_http")
LAZY_PATHS = ("ember_http", "ember_cold")  # Ember from an empty node cache: nginx, S3
EMBER_PATHS = (*LAZY_PATHS, "ember_warm")


# ===================================================================================
# The file and the servers.
# ===================================================================================


def generate(path: Path, size_gb: float) -> dict[str, Any]:
    """A transformer-like checkpoint: per layer, big fp32/bf16 matrices and small norms."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    width = 2048
    # The embedding is a few % of the whole, as in a real language model.
    tensors: dict[str, Any] = {"embed.weight": torch.randn(4096, width, generator=generator)}
    layer = 0
    total = tensors["embed.weight"].numel() * 4
    while total < size_gb * 1e9:
        prefix = f"layers.{layer}"
        tensors[f"{prefix}.norm.weight"] = torch.ones(width)
        tensors[f"{prefix}.attn.qkv.weight"] = torch.randn(3 * width, width, generator=generator)
        tensors[f"{prefix}.mlp.up.weight"] = torch.randn(4 * width, width, generator=generator).to(
            torch.bfloat16
        )
        total += sum(tensors[f"{prefix}.{n}"].nbytes for n in ("norm.weight", "attn.qkv.weight"))
        total += tensors[f"{prefix}.mlp.up.weight"].nbytes
        layer += 1
    save_file(tensors, str(path), metadata={"generated_by": "bench/weights.py"})
    return {"tensors": len(tensors), "bytes": path.stat().st_size, "layers": layer}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError as exc:
            code = getattr(exc, "code", None)
            if code is not None:  # it answered (404 for "/" is fine)
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {timeout:g} s: {exc}") from None
            time.sleep(0.1)


def nginx_binary(quiet: bool) -> Path:
    """Debian's nginx, unpacked (not installed: no service, nothing on port 80)."""
    binary = NGINX_CACHE / "root" / "usr" / "sbin" / "nginx"
    if binary.exists():
        return binary
    progress(quiet, "fetching nginx from Debian's packages (apt-get download) ...")
    NGINX_CACHE.mkdir(parents=True, exist_ok=True)
    download = NGINX_CACHE / "download"
    download.mkdir(exist_ok=True)
    subprocess.run(["apt-get", "download", "nginx"], cwd=download, check=True, capture_output=True)
    for package in download.glob("nginx_*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(package), str(NGINX_CACHE / "root")], check=True)
    if not binary.exists():
        raise RuntimeError("the nginx package did not contain usr/sbin/nginx")
    return binary


@contextlib.contextmanager
def nginx(root: Path, work: Path, quiet: bool) -> Iterator[str]:
    port = free_port()
    prefix = work / "nginx"
    prefix.mkdir()
    config = prefix / "nginx.conf"
    config.write_text(
        f"""daemon off;
user root;
worker_processes 2;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{ listen 127.0.0.1:{port}; root {root}; }}
}}
"""
    )
    process = subprocess.Popen(
        [str(nginx_binary(quiet)), "-c", str(config), "-p", str(prefix)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 API in a process of its own (it must not share the client's GIL)."""
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def aws_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }


# ===================================================================================
# Trials: each in a fresh process (`--trial`), printing one JSON line.
# ===================================================================================


def trial(kind: str, args: argparse.Namespace) -> dict[str, float]:
    # Imported before the clock starts: every path needs torch, and importing it is not
    # what is measured.
    import boto3
    import torch  # noqa: F401
    from safetensors.torch import load_file

    import ember
    from ember_worker.weights import opener  # noqa: F401
    from ember_worker.weights.origins.by_scheme import prepare
    from ember_worker.weights.totals import totals

    # Process set-up, before the clock as the imports are, but timed and reported: the
    # origin's client library and, for S3, the client (boto3's for its own path).
    set_up_began = time.perf_counter()
    client = boto3.client("s3") if kind == "boto3_then_load_file" else None
    if kind in EMBER_PATHS:
        prepare(args.url)
    set_up = time.perf_counter() - set_up_began

    began = time.perf_counter()
    if kind in EMBER_PATHS:
        view = ember.weights.open(
            args.url,
            cache_dir=Path(args.cache_dir),
            chunk_bytes=args.chunk_mb * 2**20 if args.chunk_mb else None,
            concurrency=args.concurrency,
            max_request_bytes=args.max_request_mb * 2**20 if args.max_request_mb else None,
        )
        view.get(next(iter(view)))  # the first tensor in file order
        first = time.perf_counter() - began
        tensors = view.state_dict(on_progress=lambda done, total: None)
        touch_every_page(tensors)  # as the baselines must; cheap on memory already filled
        read = totals.snapshot()
        return {
            "seconds": time.perf_counter() - began,
            "first_seconds": first,
            "set_up_seconds": set_up,
            "n": len(tensors),
            "origin_requests": read["origin_requests"],
            "origin_bytes": read["origin_bytes"],
        }
    if kind == "boto3_then_load_file":
        local = Path(args.cache_dir) / KEY
        client.download_file(BUCKET, KEY, str(local))
        tensors = load_file(str(local))
        touch_every_page(tensors)
        return {"seconds": time.perf_counter() - began, "set_up_seconds": set_up}
    if kind == "load_file_local":
        tensors = load_file(args.url)
        touch_every_page(tensors)
        return {"seconds": time.perf_counter() - began, "set_up_seconds": set_up}
    raise ValueError(kind)


def touch_every_page(tensors: dict[str, Any]) -> None:
    """`load_file` maps the file and returns at once; a tensor is in memory only once its
    pages are: read one byte of each page, as the first use of the weights would."""
    for tensor in tensors.values():
        flat = tensor.reshape(-1).view(torch_uint8())
        flat[::4096].sum()


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def run_trial(kind: str, url: str, cache_dir: Path, env: dict[str, str], args: Any) -> dict:
    command = [sys.executable, __file__, "--trial", kind, "--url", url, "--cache-dir"]
    command += [str(cache_dir)]
    if args.chunk_mb:
        command += ["--chunk-mb", str(args.chunk_mb)]
    if args.concurrency:
        command += ["--concurrency", str(args.concurrency)]
    if args.max_request_mb:
        command += ["--max-request-mb", str(args.max_request_mb)]
    result = subprocess.run(
        command,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=TRIAL_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"trial {kind} failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def run(args: argparse.Namespace, parts: Parts, result: dict[str, Any]) -> None:
    """Fill `result` as the parts go: the file's shape, then each trial's sample."""
    work = Path(tempfile.mkdtemp(prefix="ember-weights-bench-"))
    try:
        www = work / "www"
        www.mkdir()
        path = www / KEY
        parts.now = "generating the file"
        progress(args.quiet, f"generating a {args.size_gb:g} GB safetensors file ...")
        result["file"] = generate(path, args.size_gb)
        parts.now = "starting moto and nginx"
        with moto_s3() as s3_endpoint, nginx(www, work, args.quiet) as http_base:
            env = aws_env(s3_endpoint)
            parts.now = "uploading the file to moto"
            progress(args.quiet, "uploading it to the S3 API (moto, its own process) ...")
            import boto3

            client = boto3.client(
                "s3",
                endpoint_url=s3_endpoint,
                aws_access_key_id="bench",
                aws_secret_access_key="bench",
                region_name="us-east-1",
            )
            client.create_bucket(Bucket=BUCKET)
            client.upload_file(str(path), BUCKET, KEY)
            s3_url = f"s3://{BUCKET}/{KEY}"
            samples: dict[str, list[dict]] = result["samples"]
            for number in range(args.rounds):
                order = PATHS if number % 2 == 0 else PATHS[::-1]
                warm_cache = work / f"warm-{number}"
                for kind in order:
                    parts.now = f"round {number + 1}, {kind}"
                    cache = work / f"cache-{number}-{kind}"
                    shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir()
                    url = {"ember_http": f"{http_base}/{KEY}", "load_file_local": str(path)}
                    if kind == "ember_warm":
                        if not warm_cache.exists():  # fill the disk tier, untimed
                            warm_cache.mkdir()
                            run_trial("ember_cold", s3_url, warm_cache, env, args)
                        cache = warm_cache
                    progress(args.quiet, f"round {number + 1}/{args.rounds}: {kind} ...")
                    sample = run_trial(kind, url.get(kind, s3_url), cache, env, args)
                    progress(args.quiet, f"  {sample['seconds']:.2f} s")
                    samples[kind].append(sample)
                    if kind != "ember_warm":
                        shutil.rmtree(cache, ignore_errors=True)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


# ===================================================================================
# Summary and report.
# ===================================================================================


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of the paths that have samples; each verdict once its paths have."""
    samples = {k: v for k, v in result["samples"].items() if v}
    p50 = {k: statistics.median(s["seconds"] for s in v) for k, v in samples.items()}
    size = result["file"]["bytes"]
    lazy = [k for k in LAZY_PATHS if k in samples]
    # (c) over both origins; the verdict over nginx: moto reads the whole object for every
    # ranged GET, so there the first tensor costs what its few requests cost on 1 GB.
    first = {k: statistics.median(s["first_seconds"] for s in samples[k]) for k in lazy}
    first_share = {k: first[k] / p50[k] for k in lazy}
    requests = {k: statistics.median(s["origin_requests"] for s in samples[k]) for k in lazy}
    set_up = {k: statistics.median(s["set_up_seconds"] for s in v) for k, v in samples.items()}
    summary: dict[str, Any] = {
        "p50_s": p50,
        "gb_per_s": {k: size / v / 1e9 for k, v in p50.items()},
        "first_tensor_s": first,
        "first_tensor_share": first_share,
        "origin_requests": requests,
        "set_up_s": set_up,
        "verdicts": {},
    }
    if {"boto3_then_load_file", "ember_cold"} <= p50.keys():
        summary["cold_speedup"] = p50["boto3_then_load_file"] / p50["ember_cold"]
        summary["verdicts"]["cold"] = summary["cold_speedup"] >= REACH_COLD_SPEEDUP
    if {"ember_warm", "load_file_local"} <= p50.keys():
        summary["warm_ratio"] = p50["ember_warm"] / p50["load_file_local"]
        summary["verdicts"]["warm"] = summary["warm_ratio"] <= REACH_WARM_RATIO
    if "ember_http" in first_share:
        summary["verdicts"]["first_tensor"] = first_share["ember_http"] < REACH_FIRST_TENSOR
    return summary


def report(result: dict[str, Any], summary: dict[str, Any]) -> str:
    if "file" not in result:
        return "weights: no file generated: nothing measured"
    shape = result["file"]
    p50, rates = summary["p50_s"], summary["gb_per_s"]
    lines = [
        f"weights: one safetensors file of {shape['bytes'] / 1e9:.2f} GB ({shape['tensors']} "
        f"tensors, fp32 and bf16), {result['rounds']} rounds, each trial a fresh process",
        "",
        f"{'path (p50)':44}{'seconds':>10}{'GB/s':>8}",
    ]
    names = {
        "ember_cold": "ember, S3, empty node cache",
        "boto3_then_load_file": "boto3 download_file + load_file",
        "ember_warm": "ember, node cache filled (new process)",
        "load_file_local": "load_file of a local file",
        "ember_http": "ember, nginx over HTTP, empty node cache",
    }
    measured = [k for k in PATHS if k in p50]
    for kind in measured:
        lines.append(f"{'  ' + names[kind]:44}{p50[kind]:>10.2f}{rates[kind]:>8.2f}")
    by_round = {k: ", ".join(f"{s['seconds']:.2f}" for s in result["samples"][k]) for k in measured}
    lines += ["", "by round: " + "; ".join(f"{k} {v}" for k, v in by_round.items()), ""]
    verdicts = summary["verdicts"]
    first, shares = summary["first_tensor_s"], summary["first_tensor_share"]
    requests, size = summary["origin_requests"], shape["bytes"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    if "cold" in verdicts:
        lines.append(
            f"(a) cold: ember {summary['cold_speedup']:.2f}x faster than download + load_file "
            f"(reach >= {REACH_COLD_SPEEDUP:g}x): {verdict(verdicts['cold'])}"
        )
    if "warm" in verdicts:
        lines.append(
            f"(b) warm: ember {summary['warm_ratio']:.2f}x the time of a local load_file "
            f"(reach <= {REACH_WARM_RATIO:g}x): {verdict(verdicts['warm'])}"
        )
    if "first_tensor" in verdicts:
        lines.append(
            f"(c) first tensor over nginx after {first['ember_http']:.3f} s = "
            f"{shares['ember_http']:.1%} of its cold load (reach < {REACH_FIRST_TENSOR:.0%}): "
            f"{verdict(verdicts['first_tensor'])}"
        )
    if "ember_cold" in first:
        lines.append(
            f"    over S3 (moto) after {first['ember_cold']:.3f} s = "
            f"{shares['ember_cold']:.1%}: moto reads the whole object for each ranged GET, "
            "and the first tensor needs a few"
        )
    if requests:
        lines += [
            "",
            "origin requests of a cold load (p50): "
            + "; ".join(
                f"{names[k].split(',')[1].strip()} {count:g} "
                f"({size / max(count, 1) / 2**20:.1f} MiB each on average)"
                for k, count in requests.items()
            ),
        ]
    lines.append(
        "set-up before the clock, as imports (origin client library; S3 client), p50: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in summary["set_up_s"].items())
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time loading a generated safetensors file through Ember's tiered "
        "weights cache (S3 and HTTP origins, cold and warm node cache) against boto3's "
        "download_file + safetensors' load_file and a local load_file, in the same run.",
        epilog="Exit status: 0 when every verdict passes (--quick: once every verdict is "
        "printed), 1 when one misses, 2 when a part fails.",
    )
    parser.add_argument(
        "--size-gb", type=float, default=None, help="file size (1; quick 0.1: one layer)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds of every path (3; quick 1)"
    )
    parser.add_argument("--chunk-mb", type=int, default=0, help="Ember's chunk size in MiB")
    parser.add_argument("--concurrency", type=int, default=0, help="Ember's requests in flight")
    parser.add_argument(
        "--max-request-mb",
        type=int,
        default=0,
        help="the most adjacent chunks one request of Ember's may carry, in MiB "
        "(the chunk size: one chunk per request)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 0.12 GB file, one round; exit 0 once every verdict is printed",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, (full, quick) in {"size_gb": (1.0, 0.1), "rounds": (3, 1)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.rounds < 1 or args.size_gb <= 0:
        parser.error("--rounds and --size-gb must be positive")
    args.concurrency = args.concurrency or None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trial:
        print(json.dumps(trial(args.trial, args)))
        return 0
    parts = Parts("bench/weights.py")
    result: dict[str, Any] = {"samples": {p: [] for p in PATHS}, "rounds": args.rounds}
    failed = None
    try:
        run(args, parts, result)
    except Exception as error:
        failed = error
    summary = summarize(result) if "file" in result else {}
    if args.json:
        failure = {} if failed is None else {"failed": parts.line(failed)}
        print(json.dumps({**result, "summary": summary, **failure}, indent=2), flush=True)
    else:
        print(report(result, summary), flush=True)
    if failed is not None:
        parts.say(failed)
        return 2
    # A quick run's file is far smaller than the checkpoints the reach is for.
    return 0 if args.quick or all(summary["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
