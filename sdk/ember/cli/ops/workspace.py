"""`ember workspace`: the tenants of a platform. Each owns its apps, secrets, Dicts,
Queues, Volumes, calls, logs, usage and tokens; `main` exists from the first start."""

from __future__ import annotations

import argparse
import json

from ember.cli.common import admin_client, ago, check, table
from ember.endpoints.settings import check_name
from ember.errors import InvalidError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "workspace",
        help="manage workspaces (tenants)",
        description="Manage workspaces. A workspace owns apps, secrets, Dicts, Queues, "
        "Volumes, calls, logs, usage and tokens; a deploy token "
        "(`ember token create --workspace NAME --scope deploy`) acts inside its own only. "
        "Its endpoints' labels are WORKSPACE--APP--ENDPOINT; main's keep APP--ENDPOINT. "
        "An admin token acts in main, or in the one EMBER_WORKSPACE names.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser(
        "create", help="create a workspace", description="Create a workspace (admin only)."
    )
    create.add_argument("name", type=_name, help="lower-case letters, digits and hyphens")
    create.set_defaults(run=run_create)
    listing = actions.add_parser(
        "ls",
        help="list workspaces",
        description="List the workspaces and their apps (a deploy token sees its own).",
    )
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    remove = actions.add_parser(
        "rm",
        help="remove a workspace",
        description="Remove a workspace (admin only). One that still has apps is refused "
        "unless --force: then its apps are stopped, and everything it held (versions, "
        "calls, usage, Dicts, Queues, Volumes, secrets, tokens) is deleted.",
    )
    remove.add_argument("name", type=_name)
    remove.add_argument(
        "--force", action="store_true", help="stop its apps and delete everything in it"
    )
    remove.set_defaults(run=run_remove)


def _name(text: str) -> str:
    try:
        return check_name("workspace", text)
    except InvalidError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_create(args: argparse.Namespace) -> int:
    with admin_client() as client:
        check(client.post("/v1/workspaces", json={"name": args.name}), (201,))
    print(f"created workspace {args.name}")
    print(
        f"  a token for it: ember token create --workspace {args.name} --scope deploy "
        f"--name {args.name}-ci"
    )
    return 0


def run_list(args: argparse.Namespace) -> int:
    with admin_client() as client:
        workspaces = check(client.get("/v1/workspaces"))["workspaces"]
    if args.json:
        print(json.dumps(workspaces, indent=2))
        return 0
    rows = [[w["name"], ago(w["created_at"]), ", ".join(w["apps"]) or "-"] for w in workspaces]
    print(table(rows, ["NAME", "CREATED", "APPS"]))
    return 0


def run_remove(args: argparse.Namespace) -> int:
    with admin_client() as client:
        params = {"force": "true"} if args.force else {}
        result = check(client.delete(f"/v1/workspaces/{args.name}", params=params))
    stopped = result["stopped_apps"]
    print(f"removed workspace {args.name}" + (f" and its {stopped} app(s)" if stopped else ""))
    return 0
