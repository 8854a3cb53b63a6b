"""`ember history APP` and `ember rollback APP [VERSION]`: an app's versions, and going
back to one of them."""

from __future__ import annotations

import argparse
import json

from ember.cli.apps.deploy import describe
from ember.cli.common import admin_client, ago, app_name, check, table


def register(commands: argparse._SubParsersAction) -> None:
    history = commands.add_parser(
        "history",
        help="list an app's versions",
        description="List every version of an app: when it was deployed, its code (bundle "
        "digest) and endpoints, and which one serves.",
    )
    history.add_argument("app", type=app_name, metavar="APP")
    history.add_argument("--json", action="store_true", help="print the raw JSON")
    history.set_defaults(run=run_history)
    rollback = commands.add_parser(
        "rollback",
        help="serve an earlier version of an app again",
        description="Deploy the code and settings of an earlier version again, as a new "
        "version: the one before the serving version, or VERSION (see `ember history`). "
        "Running replicas drain and new ones start, as for a deploy.",
    )
    rollback.add_argument("app", type=app_name, metavar="APP")
    rollback.add_argument("version", type=int, nargs="?", metavar="VERSION")
    rollback.set_defaults(run=run_rollback)


def run_history(args: argparse.Namespace) -> int:
    with admin_client() as client:
        data = check(client.get(f"/v1/apps/{args.app}/deployments"))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    first_seen: dict[str, int] = {}
    rows = []
    for v in data["versions"]:
        digest = v["bundle_digest"]
        same = first_seen.setdefault(digest, v["version"])
        code = digest.removeprefix("sha256:")[:12]
        if same != v["version"]:
            code += f" (as v{same})"
        rows.append(
            [
                f"v{v['version']}",
                ago(v["created_at"]),
                code,
                ", ".join(v["endpoints"]),
                version_state(v),
            ]
        )
    print(table(rows, ["VERSION", "DEPLOYED", "CODE", "ENDPOINTS", ""]))
    return 0


def version_state(version: dict) -> str:
    if version["serving"]:
        return "serving"
    if version.get("canary_percent") is not None:
        return f"canary ({version['canary_percent']}% of calls)"
    return "withdrawn canary" if version.get("withdrawn") else ""


def run_rollback(args: argparse.Namespace) -> int:
    body = {} if args.version is None else {"version": args.version}
    with admin_client() as client:
        result = check(client.post(f"/v1/apps/{args.app}/rollback", json=body))
    print(
        f"rolled {args.app} back to the code and settings of v{result['rolled_back_to']}, "
        f"deployed as v{result['version']}"
    )
    print(describe(result))
    return 0
