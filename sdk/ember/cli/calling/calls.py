"""`ember calls ls|get|cancel|webhook-secret`: the spawned calls of an app (scheduled runs
among them), the result of one started with `ember call --spawn` (or `Endpoint.spawn`),
stopping one, and the secret that signs their webhooks."""

from __future__ import annotations

import argparse
import json
import re

from ember.calling.client import CallHandle
from ember.cli.common import (
    add_all_workspaces,
    admin_client,
    ago,
    check,
    listing_params,
    output_file,
    seconds_or_zero,
    table,
    with_workspaces,
    write_result,
)
from ember.config import load_config
from ember.declarations.settings import check_name
from ember.wire.labels import split_label
from ember.wire.spec import FUNCTION_METHOD


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "calls",
        help="list, get or cancel spawned calls",
        description="Calls started with `ember call --spawn` (or `Endpoint.spawn`), and the "
        "runs of scheduled endpoints. Their results are kept for a day.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "ls",
        help="list recent calls",
        description="List the newest calls, of an app or one of its endpoints if given: id, "
        "endpoint and method, status, when it started and how long it took.",
    )
    listing.add_argument("target", nargs="?", metavar="APP[--ENDPOINT]")
    listing.add_argument(
        "-n", "--limit", type=int, default=20, metavar="N", help="how many (default 20)"
    )
    add_all_workspaces(listing)
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    get = actions.add_parser(
        "get",
        help="print a call's result",
        description="Print the call's result once it has one, waiting up to --wait seconds "
        "(exit 1 with a message if it is not done by then, or if it failed).",
    )
    get.add_argument("call_id", type=_call_id, metavar="CALL_ID")
    get.add_argument(
        "--wait",
        type=seconds_or_zero,
        default=0.0,
        metavar="SECONDS",
        help="how long to wait for it to finish (default: 0, ask once)",
    )
    get.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="write the result there: the bytes of a file result, or the JSON",
    )
    get.set_defaults(run=run_get)
    cancel = actions.add_parser(
        "cancel",
        help="cancel a call",
        description="Cancel the call: taken out of its queue, or stopped on its replica "
        "(its code sees `ember.cancelled()`). Its result becomes a `cancelled` error.",
    )
    cancel.add_argument("call_id", type=_call_id, metavar="CALL_ID")
    cancel.set_defaults(run=run_cancel)
    secret = actions.add_parser(
        "webhook-secret",
        help="print the secret that signs webhooks",
        description="Print the key a webhook receiver checks deliveries with: "
        "`ember.verify_webhook(body, headers, secret)`, or any Standard Webhooks library. "
        "A call spawned with `--webhook URL` (`spawn(_webhook=URL)`) is POSTed to URL when "
        "it ends.",
    )
    secret.set_defaults(run=run_webhook_secret)


def _call_id(text: str) -> str:
    # Ids go into the URL path: nothing that could reach another route.
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,100}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a call id")
    return text


def run_list(args: argparse.Namespace) -> int:
    params = listing_params(args, {"limit": str(args.limit)})
    if args.target:
        app, _, endpoint = args.target.partition("/")
        if not endpoint and (parts := split_label(args.target)) is not None:
            app, endpoint = parts  # APP--ENDPOINT, as `ember call` takes it
        params["app"] = check_name("app", app)
        if endpoint:
            params["endpoint"] = check_name("endpoint", endpoint)
    with admin_client() as client:
        calls = check(client.get("/v1/calls", params=params))["calls"]
    if args.json:
        print(json.dumps(calls, indent=2))
        return 0
    if not calls:
        print("no calls (results are kept for a day)")
        return 0
    rows = []
    for call in calls:
        status = call["status"] + (f" ({call['http_status']})" if call["http_status"] else "")
        took = "-"
        if call["finished_at"] is not None:
            took = f"{call['finished_at'] - call['created_at']:.2f} s"
        target = call["label"] + ("" if call["method"] == FUNCTION_METHOD else "/" + call["method"])
        webhook = call.get("webhook") or "-"
        rows.append([call["call_id"], target, status, ago(call["created_at"]), took, webhook])
    header = ["CALL", "ENDPOINT", "STATUS", "CREATED", "TOOK", "WEBHOOK"]
    print(table(*with_workspaces(args, calls, rows, header)))
    return 0


def run_get(args: argparse.Namespace) -> int:
    with output_file(args.output) as output:  # a path that cannot be written fails first
        result = CallHandle(args.call_id, load_config()).get(timeout=args.wait)
        write_result(result, output)
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    CallHandle(args.call_id, load_config()).cancel()
    print(f"cancelled {args.call_id}")
    return 0


def run_webhook_secret(args: argparse.Namespace) -> int:
    with admin_client() as client:
        print(check(client.get("/v1/webhooks/secret"))["secret"])
    return 0
