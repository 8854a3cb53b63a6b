"""`ember token`: mint bearer tokens (shown once; stored hashed), list and revoke them."""

from __future__ import annotations

import argparse
import json
import re
import time

from ember.cli.common import admin_client, ago, check, duration, table
from ember.declarations.settings import check_name
from ember.errors import InvalidError

SCOPES = ["invoke", "deploy", "worker", "metrics", "admin"]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("token", help="manage API tokens", description="Manage tokens.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser(
        "create",
        help="create a token",
        description="Create a token. invoke: call a workspace's endpoints (with --app, one "
        "app's only); deploy: everything inside a workspace (deploy, stop, scale, logs, "
        "secrets, Dicts, Queues, Volumes, calls, its tokens); worker: join as a worker "
        "node; metrics: read /metrics (for Prometheus); admin: the platform operator's, "
        "every workspace. The token is printed once and stored only as a hash; `ember "
        "token ls` shows its id.",
    )
    create.add_argument("--scope", choices=SCOPES, default="invoke")
    create.add_argument(
        "--workspace",
        help="the workspace an invoke or deploy token acts in (default: the one this "
        "command acts in: its token's, or EMBER_WORKSPACE, or main)",
    )
    create.add_argument(
        "--app",
        help="an invoke token for this app's endpoints (and their calls) only",
    )
    create.add_argument("--name", default="", help="a note to recognise the token by")
    create.add_argument(
        "--rate-limit",
        metavar="N/PERIOD",
        help="calls it may make, such as 10/s, 600/min or 10000/h: bursts up to N, then "
        "that rate; a call past it gets 429 with Retry-After (each control-plane process "
        "counts its own)",
    )
    create.add_argument(
        "--expires",
        type=duration,
        metavar="AGE",
        help="how long it works, such as 1h, 30d or 90m; then requests with it get 401 "
        "saying it expired (default: it does not expire)",
    )
    create.set_defaults(run=run_create)
    listing = actions.add_parser(
        "ls",
        help="list tokens",
        description="List the stored tokens: id, scope, name and age (never the tokens).",
    )
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    revoke = actions.add_parser(
        "revoke",
        help="revoke a token",
        description="Revoke a token by its id (from `ember token ls`). Requests with it get "
        "401 at once, and workers that joined with it are disconnected. The last admin "
        "token cannot be revoked.",
    )
    revoke.add_argument("id", type=_token_id, help="the token's id, as `ember token ls` shows it")
    revoke.set_defaults(run=run_revoke)


def _token_id(text: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{12}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token id (12 hex digits, as `ember token ls` shows)"
        )
    return text


def run_create(args: argparse.Namespace) -> int:
    with admin_client() as client:
        body = {"scope": args.scope, "name": args.name}
        if args.workspace is not None:
            if args.scope not in ("invoke", "deploy"):
                raise InvalidError(
                    f"--workspace goes with invoke and deploy tokens: {args.scope} tokens "
                    "are the platform's"
                )
            body["workspace"] = check_name("workspace", args.workspace)
        if args.app is not None:
            if args.scope != "invoke":
                raise InvalidError("--app goes with --scope invoke: other tokens are for all apps")
            body["app"] = check_name("app", args.app)
        if args.rate_limit is not None:
            body["rate_limit"] = args.rate_limit
        if args.expires is not None:
            if args.expires <= 0:
                raise InvalidError("--expires must be longer than no time at all")
            body["expires_in"] = args.expires
        result = check(client.post("/v1/tokens", json=body), (201,))
    print(result["token"])
    return 0


def run_list(args: argparse.Namespace) -> int:
    with admin_client() as client:
        tokens = check(client.get("/v1/tokens"))["tokens"]
    if args.json:
        print(json.dumps(tokens, indent=2))
        return 0
    rows = [
        [
            t["id"],
            t["scope"],
            t.get("workspace") or "(all)",
            t.get("app") or "(all)" if t["scope"] == "invoke" else "-",
            t.get("rate_limit") or "-",
            t["name"] or "-",
            ago(t["created_at"]),
            expiry(t.get("expires_at")),
            "(this one)" if t["yours"] else "",
        ]
        for t in tokens
    ]
    header = ["ID", "SCOPE", "WORKSPACE", "APP", "RATE", "NAME", "CREATED", "EXPIRES", ""]
    print(table(rows, header))
    return 0


def expiry(expires_at: float | None) -> str:
    """When a token stops working, for the table: "-", "in 3d", "expired 2h ago"."""
    if expires_at is None:
        return "-"
    left = expires_at - time.time()
    if left <= 0:
        return "expired " + ago(expires_at)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if left >= size:
            return f"in {left // size:.0f}{unit}"
    return f"in {left:.0f}s"


def run_revoke(args: argparse.Namespace) -> int:
    with admin_client() as client:
        revoked = check(client.delete(f"/v1/tokens/{args.id}"))["revoked"]
    name = f" ({revoked['name']})" if revoked["name"] else ""
    print(f"revoked {revoked['scope']} token {revoked['id']}{name}")
    return 0
