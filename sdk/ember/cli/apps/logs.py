"""`ember logs APP[/ENDPOINT]`: replica output and the platform's own lines about them."""

from __future__ import annotations

import argparse
import json
import time

import httpx

from ember.calling.client import error_from_response
from ember.cli.common import admin_client, check, duration
from ember.declarations.settings import check_name
from ember.errors import InvalidError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "logs",
        help="show an app's logs",
        description="Show the stdout/stderr of an app's replicas and what the platform did.",
    )
    parser.add_argument("target", metavar="APP[/ENDPOINT]")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    parser.add_argument(
        "-n",
        "--tail",
        type=int,
        default=200,
        help="lines of history, after the filters (default 200)",
    )
    parser.add_argument(
        "--replica",
        metavar="ID",
        help="only this replica's lines (an id from `ember replica ls` or the lines, or its "
        "first characters)",
    )
    parser.add_argument(
        "--call",
        metavar="ID",
        help="only one call's lines: what its code printed, its request line, and the "
        "calls it made",
    )
    parser.add_argument(
        "--trace",
        metavar="TRACE_ID",
        help="only the request lines of one W3C trace (the X-Ember-Trace-Id of a call: it "
        "and the calls its code made)",
    )
    parser.add_argument(
        "--grep",
        metavar="TEXT",
        help="only lines that hold TEXT, in any case (a traceback's lines, an error's name)",
    )
    parser.add_argument(
        "--since",
        type=duration,
        metavar="AGE",
        help="only lines newer than AGE: 30s, 10m, 2h or 1d",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print each entry as a JSON object with all its fields (a request's entry has "
        "its timings and the token ids in and out)",
    )
    parser.set_defaults(run=run)


def format_entry(entry: dict) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(entry.get("ts", 0)))
    source = entry.get("endpoint", "")
    if entry.get("replica"):
        source += f"/{entry['replica']}"
    return f"{stamp} {source} [{entry.get('stream', '')}] {entry.get('text', '')}"


def run(args: argparse.Namespace) -> int:
    app, _, endpoint = args.target.partition("/")
    check_name("app", app)
    if endpoint:
        check_name("endpoint", endpoint)
    # The platform filters before it counts the lines -n asks for.
    params = {"tail": str(args.tail), "follow": "1" if args.follow else "0"}
    if endpoint:
        params["endpoint"] = endpoint
    if args.replica:
        params["replica"] = args.replica
    if args.call:
        params["call"] = args.call
    if args.grep:
        params["grep"] = args.grep
    if args.trace:
        params["trace"] = args.trace
    if args.since is not None:
        params["since"] = f"{time.time() - args.since:.3f}"
    with admin_client(timeout=None) as client:
        if endpoint:
            check_endpoint_known(client, app, endpoint)
        print_lines(client, app, params, args.json)
    return 0


def check_endpoint_known(client: httpx.Client, app: str, endpoint: str) -> None:
    """InvalidError for an endpoint that the app has not and never logged a line of: the
    platform's filter would answer a mistyped name with no lines, as if all were quiet."""
    rows = check(client.get("/v1/apps"))["endpoints"]
    current = sorted({row["endpoint"] for row in rows if row["app"] == app})
    if endpoint in current:
        return
    # One no longer deployed still has its lines; an unknown app is the platform's 404.
    probe = {"endpoint": endpoint, "tail": "1", "follow": "0"}
    response = client.get(f"/v1/apps/{app}/logs", params=probe)
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.content)
    if not response.content.strip():
        raise InvalidError(
            f"app {app} has no endpoint {endpoint!r} and no lines of one "
            f"(its endpoints: {', '.join(current) or 'none'})"
        )


def print_lines(client: httpx.Client, app: str, params: dict[str, str], as_json: bool) -> None:
    with client.stream("GET", f"/v1/apps/{app}/logs", params=params) as response:
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.read())
        for line in response.iter_lines():
            if line.strip():
                print(line if as_json else format_entry(json.loads(line)), flush=True)
