"""`ember calls get|cancel CALL_ID`: the result of a call started with `ember call --spawn`
(or `Endpoint.spawn`), or stop it."""

from __future__ import annotations

import argparse
import json
import re

from ember.client import CallHandle
from ember.config import load_config


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "calls",
        help="get or cancel a spawned call",
        description="Calls started with `ember call --spawn` (or `Endpoint.spawn`). Their "
        "results are kept for a day.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = actions.add_parser(
        "get",
        help="print a call's result",
        description="Print the call's result once it has one, waiting up to --wait seconds "
        "(exit 1 with a message if it is not done by then, or if it failed).",
    )
    get.add_argument("call_id", type=_call_id, metavar="CALL_ID")
    get.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long to wait for it to finish (default: 0, ask once)",
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


def _call_id(text: str) -> str:
    # Ids go into the URL path: nothing that could reach another route.
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,100}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a call id")
    return text


def run_get(args: argparse.Namespace) -> int:
    result = CallHandle(args.call_id, load_config()).get(timeout=max(0.0, args.wait))
    print(json.dumps(result, indent=2))
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    CallHandle(args.call_id, load_config()).cancel()
    print(f"cancelled {args.call_id}")
    return 0
