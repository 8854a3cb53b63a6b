"""`ember canary APP`: compare an app's canary with its serving version, change its share
of the calls, promote it or abort it."""

from __future__ import annotations

import argparse
from typing import Any

from ember.cli.common import admin_client, app_name, check, table
from ember.errors import InvalidError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "canary",
        help="compare, promote or abort an app's canary",
        description="An app's canary (`ember deploy --canary PERCENT`) takes a share of its "
        "endpoints' calls beside the serving version. Without options, print each "
        "endpoint's calls, errors (5xx) and latency in both since the canary began.",
    )
    parser.add_argument("app", type=app_name, metavar="APP")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--percent", type=int, metavar="N", help="give it N%% (1-99) of calls")
    action.add_argument(
        "--promote",
        action="store_true",
        help="it serves every call from now on; the serving version's replicas retire",
    )
    action.add_argument(
        "--abort", action="store_true", help="end it: the serving version takes every call"
    )
    parser.set_defaults(run=run)


def _cell(side: dict[str, Any]) -> list[str]:
    rate = side["error_rate"]
    p50, p95 = side["p50_s"], side["p95_s"]
    return [
        f"v{side['version']}",
        str(side["calls"]),
        "-" if rate is None else f"{rate:.1%}",
        "-" if p50 is None else f"{p50 * 1000:.0f} ms",
        "-" if p95 is None else f"{p95 * 1000:.0f} ms",
    ]


def describe(answer: dict[str, Any]) -> str:
    rows = []
    for endpoint in answer["endpoints"]:
        rows.append([endpoint["label"], "canary", *_cell(endpoint["canary"])])
        rows.append(["", "serving", *_cell(endpoint["serving"])])
    head = (
        f"{answer['app']}: canary version {answer['version']} takes {answer['percent']}% of "
        "the calls (since it began; restarts reset the counts)"
    )
    header = ["ENDPOINT", "", "VERSION", "CALLS", "ERRORS", "P50", "P95"]
    return head + "\n" + table(rows, header)


def run(args: argparse.Namespace) -> int:
    path = f"/v1/apps/{args.app}/canary"
    with admin_client() as client:
        if args.promote:
            result = check(client.post(path + "/promote"))
            print(
                f"promoted: version {result['version']} of {args.app} serves every call; "
                "the older version's replicas retire once its own are ready"
            )
        elif args.abort:
            result = check(client.delete(path))
            print(f"aborted: canary version {result['version']} of {args.app} is withdrawn")
        elif args.percent is not None:
            if not 1 <= args.percent <= 99:
                raise InvalidError("--percent takes 1 to 99 (--promote gives it every call)")
            print(describe(check(client.patch(path, json={"percent": args.percent}))))
        else:
            print(describe(check(client.get(path))))
    return 0
