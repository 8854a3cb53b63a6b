"""`ember workspace`: the tenants of a platform. Each owns its apps, secrets, Dicts,
Queues, Volumes, calls, logs, usage and tokens; `main` exists from the first start."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ember.cli.common import admin_client, ago, check, table
from ember.declarations.settings import check_name
from ember.errors import InvalidError

LIMITS = ("max_queued", "max_running", "rate")  # as the API names them
DEFAULT = "default"  # a limit back to the server's default


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
        description="List the workspaces, their admission limits (those not set for a "
        "workspace marked as the server's defaults) and their apps (a deploy token sees its "
        "own).",
    )
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    limits = actions.add_parser(
        "set",
        help="set a workspace's admission limits",
        description="Set a workspace's admission limits (admin only). Past one, its calls "
        "(spawned, synchronous, streamed, web apps') get 429 with Retry-After, naming the "
        "workspace and the limit; calls accepted before are never dropped for it. Each "
        "limit not set is the server's default (`ember server --workspace-max-queued "
        "--workspace-max-running --workspace-rate`); `default` puts one back to it.",
    )
    limits.add_argument("name", type=_name, help="the workspace (main too)")
    limits.add_argument(
        "--max-queued",
        type=_count_or_default,
        metavar="N",
        help="inputs it may have waiting in its endpoints' queues, over all of them",
    )
    limits.add_argument(
        "--max-running",
        type=_count_or_default,
        metavar="N",
        help="calls it may have running on replicas at once",
    )
    limits.add_argument(
        "--rate",
        metavar="N/PERIOD",
        help="calls it may start, such as 100/s, 6000/min or 100000/h: bursts up to N, then "
        "that rate (`none`: no limit; each control-plane process counts its own)",
    )
    limits.set_defaults(run=run_set)
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


def _count_or_default(text: str) -> int | str:
    """An argparse type: a whole number above zero, or `default`."""
    if text == DEFAULT:
        return text
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above zero or default")
    return int(text)


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
    rows = [
        [
            w["name"],
            ago(w["created_at"]),
            *(_limit(w["limits"], name) for name in LIMITS),
            ", ".join(w["apps"]) or "-",
        ]
        for w in workspaces
    ]
    print(table(rows, ["NAME", "CREATED", "MAX QUEUED", "MAX RUNNING", "RATE", "APPS"]))
    return 0


def run_set(args: argparse.Namespace) -> int:
    given = {"max_queued": args.max_queued, "max_running": args.max_running, "rate": args.rate}
    # A limit not given stays as it is; `default` is sent as null, the server's default.
    changes = {name: None if v == DEFAULT else v for name, v in given.items() if v is not None}
    if not changes:
        raise InvalidError("name a limit to set: --max-queued, --max-running or --rate")
    with admin_client() as client:
        answer = check(client.patch(f"/v1/workspaces/{args.name}/limits", json=changes))
    print(f"workspace {args.name}: {_limits_text(answer['limits'])}")
    return 0


def _limits_text(limits: dict[str, Any]) -> str:
    return ", ".join(f"{name} {_limit(limits, name)}" for name in LIMITS)


def _limit(limits: dict[str, Any], name: str) -> str:
    """A limit as `ls` shows it: its value, marked where it is the server's default."""
    value = "none" if limits[name] is None else str(limits[name])
    return value if name in limits["set"] else f"{value} (default)"


def run_remove(args: argparse.Namespace) -> int:
    with admin_client() as client:
        params = {"force": "true"} if args.force else {}
        result = check(client.delete(f"/v1/workspaces/{args.name}", params=params))
    stopped = result["stopped_apps"]
    print(f"removed workspace {args.name}" + (f" and its {stopped} app(s)" if stopped else ""))
    return 0
