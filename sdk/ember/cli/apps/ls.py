"""`ember ls`: deployed endpoints, their replicas and queues, and the worker nodes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ember.cli.common import (
    add_all_workspaces,
    admin_client,
    ago,
    app_name,
    check,
    listing_params,
    table,
    with_workspaces,
)
from ember.declarations.node_labels import format_labels
from ember.declarations.schedules import format_seconds


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "ls", help="list deployed endpoints", description="List endpoints, replicas and workers."
    )
    parser.add_argument(
        "app", nargs="?", type=app_name, metavar="APP", help="only this app's endpoints"
    )
    add_all_workspaces(parser)
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.set_defaults(run=run)


def schedule_row(endpoint: dict[str, Any]) -> list[str]:
    schedule = endpoint["schedule"]
    next_at = schedule.get("next_run_at")
    upcoming = (
        "-" if next_at is None else f"in {format_seconds(max(0, round(next_at - time.time())))}"
    )
    last = schedule.get("last_run")
    if last is None:
        done = "-"
    else:
        status = last.get("status", "gone")
        if last.get("http_status"):
            status += f" ({last['http_status']})"
        done = f"{last['call_id']} {status}, {ago(last['started_at'])}"
    return [endpoint["label"], schedule["schedule"], upcoming, done]


def run(args: argparse.Namespace) -> int:
    with admin_client() as client:
        data = check(client.get("/v1/apps", params=listing_params(args, {})))
    if args.app is not None:
        data["endpoints"] = [e for e in data["endpoints"] if e["app"] == args.app]
        if not data["endpoints"]:
            print(
                f"ember ls: no endpoints of an app named {args.app} are deployed", file=sys.stderr
            )
            return 1
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = []
    for e in data["endpoints"]:
        settings = e["settings"]
        replicas = ", ".join(f"{n} {s}" for s, n in sorted(e["replicas"].items())) or "0"
        extras = []
        if settings.get("gpu"):
            gpu = settings["gpu"]
            extras.append("gpu=" + (",".join(gpu) if isinstance(gpu, list) else gpu))
        used = e.get("replica_memory_bytes")
        if used:
            extras.append(f"mem {used / 2**20:.0f}/{settings['memory']} MiB")
        if settings.get("memory_limit"):
            extras.append(f"memory_limit={settings['memory_limit']}")
        if settings.get("cpu_limit"):
            extras.append(f"cpu_limit={settings['cpu_limit']:g}")
        if settings.get("node_labels"):
            extras.append("node_labels=" + format_labels(settings["node_labels"]))
        if settings.get("max_inputs"):
            extras.append(f"max_inputs={settings['max_inputs']}")
        if settings.get("weights"):
            extras.append("weights=" + ",".join(sorted(settings["weights"])))
        if not settings.get("snapshot"):
            extras.append("snapshot=False")
        elif e.get("snapshot_note"):
            extras.append(e["snapshot_note"])
        elif e.get("snapshots"):
            size = sum(s["size"] for s in e["snapshots"])
            restores = sum(s.get("restores", 0) for s in e["snapshots"])
            plural = "" if restores == 1 else "s"
            extras.append(f"snapshot {size / 1e6:.0f} MB, {restores} restore{plural}")
        start = e.get("last_start")
        if start:
            kind = f"{start['kind']} (lazy)" if start.get("lazy") else start["kind"]
            extras.append(f"last start: {kind} {start['total_seconds']:.2f} s")
            if start.get("image_root"):
                extras.append(f"image root: {start['image_root']}")
        unhealthy = e.get("last_unhealthy")
        if unhealthy:
            extras.append(f"last unhealthy: {unhealthy['replica']} {ago(unhealthy['at'])}")
        if e.get("scaling_override"):
            changed = ", ".join(f"{k}={v:g}" for k, v in sorted(e["scaling_override"].items()))
            extras.append(f"scaled: {changed} (until the next deploy)")
        rollout = e.get("rollout") or {}
        if rollout.get("previous"):
            extras.append(
                f"rolling out: {rollout['ready']} ready, {rollout['starting']} starting, "
                f"{rollout['previous']} older left"
            )
        canary = e.get("canary")
        if canary:
            states = ", ".join(f"{n} {s}" for s, n in sorted(canary["replicas"].items())) or "0"
            extras.append(f"canary v{canary['version']} {canary['percent']}%: {states}")
        if e.get("unservable"):
            extras.append("UNSERVABLE: " + e["unservable"])
        if e.get("placement_wait"):  # a gang not placed yet
            extras.append("WAITING: " + e["placement_wait"])
        if e.get("last_startup_error"):  # until one of its replicas is ready
            extras.append("FAILS TO START: " + e["last_startup_error"])
        rows.append(
            [
                e["label"],
                f"v{e['version']}",
                replicas,
                f"{settings['min_replicas']}..{settings['max_replicas']}"
                + ("*" if e.get("scaling_override") else ""),
                str(e["queued"]),
                str(e["running"]),
                e["urls"][0],
                " ".join(extras),
            ]
        )
    if rows:
        header = ["ENDPOINT", "VER", "REPLICAS", "SCALE", "QUEUED", "RUNNING", "URL", ""]
        print(table(*with_workspaces(args, data["endpoints"], rows, header)))
    else:
        print("no endpoints deployed; `ember deploy app.py` deploys one")
    scheduled = [e for e in data["endpoints"] if e.get("schedule")]
    if scheduled:
        print("\nscheduled:")
        print(table([schedule_row(e) for e in scheduled], ["ENDPOINT", "SCHEDULE", "NEXT", "LAST"]))
    workers = data["workers"]
    print(
        f"\n{len(workers)} worker(s): "
        + ", ".join(
            f"{w['name']} ({w['cpu']:g} CPU, {w['memory'] // 1024} GiB"
            + "".join(f", {n}x{g}" for g, n in w["gpus"].items())
            + (", " + format_labels(w["labels"]) if w.get("labels") else "")
            + ")"
            for w in workers
        )
    )
    for w in workers:
        for setting in ("memory_limit", "cpu_limit"):
            problem = w.get(f"{setting}s_problem")
            if problem and any(e["settings"].get(setting) for e in data["endpoints"]):
                print(f"worker {w['name']} cannot enforce {setting}=: {problem}")
    return 0
