"""A first restore on a node that fetched the image ahead, when it was published, against
one that must download it first, in the same run.

One `ember server` with its local worker, and a second worker on this machine (`node-b`).
The endpoint's `enter(snap=True)` fills `--state-mb` of random bytes (incompressible, as
weights are). Its first replica boots cold on the local worker and is snapshotted; node-b
fetches the image ahead. The local worker is then drained, so every later replica starts
on node-b, restored. Rounds alternate between `ahead` (the image in node-b's cache, as the
fetch ahead left it) and `download` (removed from node-b's cache first, as it was before
images were fetched ahead). Each round waits for zero replicas, then times one call from
the request to its answer, and reads the restore's fetch phase from `ember ls`'s data.

    .venv/bin/python bench/snapshot_prefetch.py            # about two minutes
    .venv/bin/python bench/snapshot_prefetch.py --quick    # 16 MB of state, one round
    .venv/bin/python bench/snapshot_prefetch.py --state-mb 1024 --rounds 5 --json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from procs import (
    Parts,
    ServerProcess,
    isolated_env,
    platform_with_app,
    progress,
    stopped_at_exit,
)

APP = "prefetchbench"
LABEL = f"{APP}--ballast"
APP_SOURCE = """\
import os

import ember


@ember.endpoint(name="ballast", scaledown_window=1, concurrency=1)
class Ballast:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.state = os.urandom({state_mb} << 20)  # incompressible, like weights

    @ember.method
    def size(self) -> int:
        return len(self.state)
"""


def _status(client: Any) -> dict[str, Any]:
    return next(e for e in client.get("/v1/apps").json()["endpoints"] if e["label"] == LABEL)


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not within {timeout:g} s")


def _join_worker(work: Path, url: str, token: str, ca: str, env: dict[str, str]) -> ServerProcess:
    command = [sys.executable, "-m", "ember.cli.main", "worker", "--server", url]
    command += ["--token", token, "--ca-cert", ca, "--work-dir", str(work / "node-b")]
    command += ["--name", "node-b"]
    return ServerProcess.start("node-b", command, work / "node-b.log", env)


def run(args: argparse.Namespace, parts: Parts, result: dict[str, Any]) -> None:
    """Fill `result` as the parts go: the image's size, then each round's figures."""
    import ember
    from ember.calling.connections import platform_client
    from ember_worker.snapshots.node_cache import image_name  # the node cache's folder of an image

    rounds: dict[str, list[dict[str, float]]] = result["rounds"]
    work = Path(tempfile.mkdtemp(prefix="ember-prefetch-bench-"))
    try:
        env = isolated_env(work)
        (work / "app").mkdir()
        (work / "app" / "app.py").write_text(APP_SOURCE.format(state_mb=args.state_mb))
        with stopped_at_exit() as started:
            parts.now = "starting ember server and deploying"
            progress(args.quiet, parts.now)
            _, config = platform_with_app(work, work / "app" / "app.py", APP, env, started)
            parts.now = "joining node-b"
            ember_cli = [sys.executable, "-m", "ember.cli.main"]
            made = subprocess.run(
                [*ember_cli, "token", "create", "--scope", "worker"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            started.append(
                _join_worker(work, config.server_url, made.stdout.strip(), config.ca_cert, env)
            )
            with platform_client(config, 300.0) as client:
                _wait(lambda: len(client.get("/v1/apps").json()["workers"]) == 2, 60, "node-b")
                ballast = ember.Endpoint.lookup(APP, "ballast", config=config)
                parts.now = "the first replica (cold) and its snapshot"
                progress(args.quiet, f"first replica: cold, {args.state_mb} MB of state")
                ballast.size.call()
                _wait(lambda: _status(client)["snapshots"], 300, "the snapshot")
                image = _status(client)["snapshots"][0]
                cached = work / "node-b" / "snapshots" / image_name(image["key"], image["image_id"])
                parts.now = "node-b's fetch ahead"
                _wait((cached / "images" / "meta.json").exists, 300, "the fetch ahead")
                result["image_bytes"] = _status(client)["snapshots"][0]["size"]
                parts.now = "draining the local worker"
                subprocess.run(
                    [*ember_cli, "node", "drain", "local", "--wait", "--timeout", "120"],
                    env=env,
                    check=True,
                    capture_output=True,
                )
                for number in range(args.rounds):
                    for side in ("ahead", "download"):
                        parts.now = f"round {number + 1}, {side}"
                        _wait(lambda: not _status(client)["replicas"], 120, "zero replicas")
                        if side == "download":
                            shutil.rmtree(cached)
                        began = time.perf_counter()
                        ballast.size.call()
                        answered = time.perf_counter() - began
                        start = _status(client)["last_start"]
                        if start["kind"] != "restore":
                            raise RuntimeError(f"round {number}: not a restore: {start}")
                        rounds[side].append(
                            {
                                "answer_s": answered,
                                "fetch_s": float(start.get("fetch_seconds", 0.0)),
                                "restore_s": float(start.get("restore_seconds", 0.0)),
                            }
                        )
                        progress(
                            args.quiet,
                            f"round {number + 1} {side}: answer {answered:.2f} s, fetch "
                            f"{rounds[side][-1]['fetch_s']:.2f} s",
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians of each side that has rounds, and their ratio once both have."""
    medians = {
        side: {name: statistics.median(r[name] for r in rows) for name in rows[0]}
        for side, rows in result["rounds"].items()
        if rows
    }
    summary = {**result, "medians": medians}
    if len(medians) == 2:
        ahead, download = medians["ahead"]["answer_s"], medians["download"]["answer_s"]
        summary["ahead_over_download"] = ahead / download
    return summary


def report(summary: dict[str, Any]) -> str:
    image = summary.get("image_bytes")
    lines = [
        f"first restore on another node: {summary['state_mb']} MB of state, image "
        + (f"{image / 1e6:.0f} MB compressed" if image else "not published")
        + f", median of {len(summary['rounds']['ahead'])} rounds each",
        f"{'':>10}  {'answer':>8}  {'fetch':>8}  {'restore':>8}",
    ]
    for side, m in summary["medians"].items():
        lines.append(
            f"{side:>10}  {m['answer_s']:7.2f}s  {m['fetch_s']:7.2f}s  {m['restore_s']:7.2f}s"
        )
    if "ahead_over_download" in summary:
        ratio = summary["ahead_over_download"]
        lines.append(f"fetched ahead / downloaded: {ratio:.2f}x the time")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A first restore on a node with the snapshot fetched ahead, against one "
        "that downloads it first."
    )
    parser.add_argument(
        "--state-mb", type=int, default=None, help="the replica's state (256; quick 16)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds of each side (3; quick 1)")
    parser.add_argument("--quick", action="store_true", help="16 MB of state, one round")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    for name, (full, quick) in {"state_mb": (256, 16), "rounds": (3, 1)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    parts = Parts("bench/snapshot_prefetch.py")
    result: dict[str, Any] = {"state_mb": args.state_mb, "rounds": {"ahead": [], "download": []}}
    failed = None
    try:
        run(args, parts, result)
    except Exception as error:
        failed = error
    return 2 if parts.show(summarize(result), failed, args.json, report) else 0


if __name__ == "__main__":
    sys.exit(main())
