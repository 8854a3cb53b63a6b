"""`ember deploy FILE.py`: bundle the app's folder, upload it, print the endpoints' URLs."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.bundle import Bundle, build_bundle
from ember.cli.apps.image_builds import build_images
from ember.cli.common import admin_client, check, positive_number
from ember.config import ClientConfig, load_config
from ember.declarations.settings import check_name, normalize_name
from ember.endpoints.loader import find_endpoints, import_app_file
from ember.errors import InvalidError
from ember.ignore_rules import IGNORE_FILE
from ember.wire.spec import AppManifest

ROLLOUT_POLL_SECONDS = 0.5


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "deploy",
        help="deploy the endpoints of a Python file",
        description="Import FILE.py to find its @ember.endpoint definitions, upload the folder "
        "that holds it as a bundle, and print one URL per endpoint. Deploying again "
        "replaces the app's endpoints without downtime: the old version's replicas serve "
        "until the new one's are ready (unless an endpoint says rollout='recreate').",
    )
    parser.add_argument("file", type=Path, metavar="FILE.py", help="the app's entry file")
    parser.add_argument(
        "--name", help="app name (default: the folder's name for app.py/main.py, else the file's)"
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="return once the new version serves: each endpoint has its min_replicas "
        "ready and no older replica left; exit 1 if its replicas fail to start (for CI/CD)",
    )
    parser.add_argument(
        "--canary",
        type=int,
        metavar="PERCENT",
        help="try the new version beside the serving one on PERCENT (1-99) of the calls, "
        "until `ember canary APP --promote` gives it all of them or `--abort` ends it "
        "(calls with the same affinity key stay on one version)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_number,
        default=600.0,
        metavar="SECONDS",
        help="with --wait: how long to wait (default 600)",
    )
    parser.set_defaults(run=run)


def default_app_name(file: Path) -> str:
    stem = file.resolve().parent.name if file.stem in ("app", "main") else file.stem
    return normalize_name(stem)


def deploy(
    file: Path,
    app: str | None = None,
    config: ClientConfig | None = None,
    canary_percent: int | None = None,
) -> dict[str, Any]:
    """Deploy `file` and return the platform's answer (endpoints with their URLs); with
    `canary_percent`, as a canary beside the serving version."""
    config = config or load_config()
    if not file.is_file():
        raise InvalidError(f"no such file: {file}")
    # An empty --name is a name too, and the check refuses it: not the default's place.
    app_name = check_name("app", default_app_name(file) if app is None else app)
    module = import_app_file(file)
    endpoints = find_endpoints(module)
    if not endpoints:
        raise InvalidError(f"{file} defines no @ember.endpoint(...); nothing to deploy")
    app_dir = file.resolve().parent
    manifest = AppManifest(
        app=app_name,
        entry=file.resolve().relative_to(app_dir).as_posix(),
        endpoints=[definition.spec(attribute) for attribute, definition in endpoints.items()],
    )
    bundle = build_bundle(app_dir)
    if manifest.entry not in bundle.files:
        raise InvalidError(
            f"{app_dir / IGNORE_FILE} leaves out {manifest.entry}, the entry file, so no "
            "replica could import it: change the rule that matches it"
        )
    with admin_client(config, timeout=300.0) as client:
        build_images(client, manifest)  # on a worker node, unless built already
        check(client.put(f"/v1/bundles/{bundle.digest}", content=_upload(bundle)), (201,))
        return check(
            client.post(
                f"/v1/apps/{app_name}/deployments",
                json={
                    "manifest": manifest.to_dict(),
                    "bundle_digest": bundle.digest,
                    **({} if canary_percent is None else {"canary_percent": canary_percent}),
                },
            )
        )


def _upload(bundle: Bundle, chunk: int = 1024 * 1024) -> Iterator[bytes]:
    """The bundle in chunks, with a progress line on a terminal for bundles over a chunk."""
    total = len(bundle.data)
    show = sys.stderr.isatty() and total > chunk
    for start in range(0, total, chunk):
        yield bundle.data[start : start + chunk]
        if show:
            done = min(start + chunk, total)
            print(
                f"\ruploading bundle: {done * 100 // total:3d}% "
                f"({done / 1e6:.1f}/{total / 1e6:.1f} MB, {bundle.file_count} files)",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if show:
        print(file=sys.stderr)


def describe(result: dict[str, Any]) -> str:
    lines = [f"deployed app {result['app']} (version {result['version']}):"]
    if result.get("canary_percent") is not None:
        lines[0] = (
            f"deployed app {result['app']} version {result['version']} as a canary: it takes "
            f"{result['canary_percent']}% of the calls beside version "
            f"{result['serving_version']} (`ember canary {result['app']}` compares them, "
            "`--promote` or `--abort` ends it):"
        )
    for endpoint in result["endpoints"]:
        methods = [m for m in endpoint["methods"] if m != "__call__"]
        suffix = f"  methods: {', '.join(methods)}" if methods else ""
        lines.append(f"  {endpoint['label']}  {endpoint['urls'][0]}{suffix}")
        for url in endpoint["urls"][1:]:
            lines.append(f"  {' ' * len(endpoint['label'])}  {url}")
        if endpoint.get("unservable"):
            lines.append(f"    warning: {endpoint['unservable']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.timeout != 600.0 and not args.wait:
        raise InvalidError("--timeout goes with --wait")
    result = deploy(args.file, args.name, canary_percent=args.canary)
    print(describe(result))
    sys.stdout.flush()
    if args.wait:
        wait_for_rollout(result, args.timeout)
    return 0


def wait_for_rollout(result: dict[str, Any], timeout: float) -> None:
    """Until every endpoint of the deployed version has its min_replicas ready and no
    replica of an older version is left; InvalidError when its replicas fail to start
    or the time runs out. Says how far it is whenever that changes."""
    version = result["version"]
    labels = {e["label"] for e in result["endpoints"]}
    deadline = time.monotonic() + timeout
    said = ""
    with admin_client() as client:
        while True:
            rows = {
                row["label"]: row
                for row in check(client.get("/v1/apps"))["endpoints"]
                if row["label"] in labels
            }
            waiting = []
            for label in sorted(labels):
                row = rows.get(label)
                if result.get("canary_percent") is not None:
                    canary = (row or {}).get("canary") or {}
                    if canary.get("version") != version:
                        raise InvalidError(f"{label} no longer has version {version} as a canary")
                    if canary.get("last_startup_error"):
                        raise InvalidError(
                            f"canary version {version} of {label} fails to start: "
                            f"{canary['last_startup_error']} (version "
                            f"{result['serving_version']} serves every call meanwhile)"
                        )
                    ready = canary["replicas"].get("ready", 0)
                    if ready < canary["min_replicas"]:
                        waiting.append(f"{label}: canary {ready}/{canary['min_replicas']} ready")
                    continue
                if row is None or row["version"] != version:
                    raise InvalidError(f"{label} is no longer at version {version}")
                if row.get("last_startup_error"):
                    raise InvalidError(
                        f"version {version} of {label} fails to start: "
                        f"{row['last_startup_error']} (the older version, if any, still "
                        f"serves; `ember logs {result['app']}` says more)"
                    )
                rollout = row["rollout"]
                wanted = row["settings"]["min_replicas"]
                if rollout["ready"] < wanted or rollout["previous"]:
                    waiting.append(
                        f"{label}: {rollout['ready']}/{wanted} ready, "
                        f"{rollout['previous']} older replica(s) left"
                    )
            if not waiting:
                canary = result.get("canary_percent")
                said_done = f"canary version {version} serves {canary}% of calls"
                print(said_done if canary is not None else f"version {version} serves", flush=True)
                return
            news = "; ".join(waiting)
            if news != said:
                print(f"waiting: {news}", file=sys.stderr, flush=True)
                said = news
            if time.monotonic() > deadline:
                raise InvalidError(
                    f"version {version} did not roll out within {timeout:g} s: {news}"
                )
            time.sleep(ROLLOUT_POLL_SECONDS)
