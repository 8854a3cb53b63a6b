"""`ember snapshot ls|rm`: the process images replicas restore from. What each endpoint
has (its size, its use, the nodes that hold it), why one has none, and dropping an
endpoint's images so that its next replica takes a new one."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import httpx

from ember.cli.common import (
    add_all_workspaces,
    admin_client,
    ago,
    check,
    listing_params,
    table,
    with_workspaces,
)
from ember.errors import InvalidError
from ember.wire.labels import split_label

KEY_PREFIX = re.compile(r"[0-9a-f]{6,32}\Z")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "snapshot",
        help="list snapshot images, or drop an endpoint's",
        description="The process images that replicas restore from: the first replica of "
        "an endpoint's version is snapshotted after its enter(snap=True) hooks, and the "
        "others restore from that image instead of booting cold.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "ls",
        help="list snapshot images",
        description="List the stored images, the newest first: endpoint, version, size "
        "compressed and in memory, how long the dump took, age, how many replicas were "
        "restored from it, when last and how long that one took from placement to "
        "ready, and the nodes that hold a copy; then those "
        "being taken or that failed (with CRIU's reason), and the endpoints that have "
        "none, with why.",
    )
    listing.add_argument("target", nargs="?", metavar="APP[--ENDPOINT]", help="only these")
    add_all_workspaces(listing)
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    drop = actions.add_parser(
        "rm",
        help="drop an endpoint's snapshot images",
        description="Drop the images of TARGET: an app (all its endpoints'), "
        "APP--ENDPOINT, or an image's key (its first characters will do). Replicas "
        "running now keep serving; the next to start boots cold and takes a new image. "
        "Use it when what enter(snap=True) loaded changed without a change to the code "
        "in a way Ember cannot see (a file it downloaded itself; weights read through "
        "weights= or ember.weights.open are checked at every restore), or to retry at "
        "once a snapshot that failed.",
    )
    drop.add_argument("target", metavar="TARGET")
    drop.add_argument(
        "--restart",
        action="store_true",
        help="also stop the replicas running now (each after the inputs it runs, as "
        "`ember replica stop` does), so that every replica starts afresh; calls "
        "meanwhile wait for the new ones",
    )
    drop.set_defaults(run=run_drop)


def _selector(target: str | None) -> tuple[str | None, str | None]:
    """(app, endpoint or None) of an APP, APP--ENDPOINT or APP/ENDPOINT argument."""
    if not target:
        return None, None
    if "/" in target:
        app, _, endpoint = target.partition("/")
        return app, endpoint
    parts = split_label(target)
    return parts if parts is not None else (target, None)


def _megabytes(size: int | None) -> str:
    return f"{size / 1e6:.0f} MB" if size else "-"


def _row(snapshot: dict[str, Any]) -> list[str]:
    version = snapshot.get("version")
    last = snapshot.get("last_restored_at")
    took = snapshot.get("last_restore_seconds")
    created = snapshot.get("created_at")
    dump = snapshot.get("dump_seconds")
    return [
        snapshot["label"],
        snapshot["key"][:12],
        snapshot["state"],
        f"v{version}" if version is not None else "-",
        _megabytes(snapshot.get("size")),
        _megabytes(snapshot.get("raw_size")),
        f"{dump:.2f} s" if dump is not None else "-",
        ago(created) if created else "-",
        str(snapshot.get("restores", "-")),
        (ago(last) + (f" in {took:.2f} s" if took is not None else "")) if last else "-",
        ", ".join(snapshot.get("nodes") or []) or "-",
    ]


def _in_minutes(seconds: float) -> str:
    return f"{max(0.0, seconds) / 60:.0f} min"


def _failure(snapshot: dict[str, Any], now: float) -> str:
    return (
        f"{snapshot['label']}: the snapshot {snapshot['key'][:12]} failed "
        f"{ago(snapshot['failed_at'])}, next try in {_in_minutes(snapshot['retry_at'] - now)} "
        f"(`ember snapshot rm {snapshot['label']}` tries at once): {snapshot['reason'] or '-'}"
    )


def _without_snapshot(endpoint: dict[str, Any]) -> str:
    if not endpoint["snapshot"]:
        why = "snapshot=False: its replicas always boot cold"
    elif endpoint.get("note"):
        why = f"its replicas boot cold: {endpoint['note']}"
    else:
        why = "none yet: the next replica to start takes one"
    return f"{endpoint['label']}: {why}"


def run_list(args: argparse.Namespace) -> int:
    app, endpoint = _selector(args.target)
    params = listing_params(args, {"app": app} if app else {})
    with admin_client() as client:
        data = check(client.get("/v1/snapshots", params=params))
    snapshots = [s for s in data["snapshots"] if endpoint is None or s["endpoint"] == endpoint]
    endpoints = [e for e in data["endpoints"] if endpoint is None or e["endpoint"] == endpoint]
    if args.json:
        print(json.dumps({"snapshots": snapshots, "endpoints": endpoints}, indent=2))
        return 0
    shown = [s for s in snapshots if s["state"] != "failed"]
    if shown:
        header = ["ENDPOINT", "SNAPSHOT", "STATE", "VER", "SIZE", "MEMORY", "DUMP", "TAKEN"]
        header += ["RESTORES", "LAST RESTORE", "NODES"]
        print(table(*with_workspaces(args, shown, [_row(s) for s in shown], header)))
    for failed in (s for s in snapshots if s["state"] == "failed"):
        print(_failure(failed, data["now"]))
    with_rows = {s["label"] for s in snapshots}
    for without in (e for e in endpoints if e["label"] not in with_rows):
        print(_without_snapshot(without))
    if not snapshots and not endpoints:
        where = f" for {args.target}" if args.target else ""
        print(f"no snapshots{where}, and no endpoints deployed there")
    return 0


def _image_of(client: httpx.Client, prefix: str) -> dict[str, Any] | None:
    """The stored image whose key starts with `prefix`, or None if none does."""
    stored = check(client.get("/v1/snapshots"))["snapshots"]
    matches = [s for s in stored if s["state"] == "ready" and s["key"].startswith(prefix)]
    if len(matches) > 1:
        keys = ", ".join(s["key"] for s in matches)
        raise InvalidError(f"{prefix} could be any of {keys}: give more of it")
    return matches[0] if matches else None


def _stop_replicas(client: httpx.Client, app: str | None, endpoint: str | None) -> int:
    """Drain the replicas of the app's endpoints (or of one); how many."""
    replicas = check(client.get("/v1/replicas", params={"app": app} if app else {}))["replicas"]
    chosen = [r for r in replicas if endpoint is None or r["endpoint"] == endpoint]
    for replica in chosen:
        check(client.delete(f"/v1/replicas/{replica['id']}"), (200, 404))  # 404: gone since
    return len(chosen)


def run_drop(args: argparse.Namespace) -> int:
    app, endpoint = _selector(args.target)
    with admin_client() as client:
        image = _image_of(client, args.target) if KEY_PREFIX.match(args.target) else None
        if image is not None:
            result = check(client.delete(f"/v1/snapshots/{image['key']}"))
            app, endpoint = image["app"], image["endpoint"]
        else:
            params = {"app": app, **({"endpoint": endpoint} if endpoint else {})}
            result = check(client.delete("/v1/snapshots", params=params))
        stopped = _stop_replicas(client, app, endpoint) if args.restart else None
    dropped, forgotten = result["dropped"], result["failures_forgotten"]
    if stopped is not None:
        plural = "" if stopped == 1 else "s"
        print(f"stopping {stopped} replica{plural} once their inputs are done")
    if not dropped and not forgotten:
        print(f"{args.target} has no snapshots stored: nothing to drop")
        return 0
    if dropped:
        keys = ", ".join(k[:12] for k in dropped)
        plural = "s" if len(dropped) > 1 else ""
        print(f"dropped {len(dropped)} snapshot{plural} of {args.target}: {keys}")
    if forgotten:
        print(f"forgot {forgotten} failed snapshot{'s' if forgotten > 1 else ''}")
    if stopped is None:
        print("replicas running now keep serving (--restart stops them); the next to start")
        print("boots cold and takes a new image")
    else:
        print("the next replica to start boots cold and takes a new image")
    return 0
