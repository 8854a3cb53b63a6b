"""`ember run FILE.py ENDPOINT '{json}'`: deploy the file as an app of its own, call one
endpoint once with the replicas' output shown as it comes, print the result, and stop
the app: a one-off job (a data pass, an evaluation) on the platform's nodes."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import threading
from pathlib import Path

import httpx

from ember.cli.call import add_file_options, call_arguments, write_stream
from ember.cli.common import admin_client, check, stop_on_signals, write_result
from ember.cli.deploy import default_app_name, deploy
from ember.cli.logs import format_entry
from ember.client import Endpoint
from ember.config import ClientConfig, load_config
from ember.errors import InvalidError
from ember.labels import make_label
from ember.settings import check_name
from ember.spec import FUNCTION_METHOD

# Replica output, not the platform's notes about starting and stopping replicas.
SHOWN_STREAMS = ("stdout", "stderr")
# Replicas' output reaches the platform in batches, a tenth of a second apart: lines
# printed just before the answer are waited for this long.
LAST_LINES_SECONDS = 0.5


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="deploy a file, call one endpoint once, stop it",
        description="Deploy FILE.py as an app of its own (named after the file, with a "
        "random suffix), call ENDPOINT (or ENDPOINT/METHOD) once with the keyword "
        "arguments given as a JSON object, show what its replicas print while it runs, "
        "print the result, and stop the app (Ctrl+C stops it too).",
    )
    parser.add_argument("file", type=Path, metavar="FILE.py")
    parser.add_argument("endpoint", metavar="ENDPOINT[/METHOD]")
    parser.add_argument("arguments", nargs="?", default="{}", metavar="'{json}'")
    parser.add_argument("--stream", action="store_true", help="read it as a stream")
    add_file_options(parser, "--file-argument")  # --file would read as the FILE.py
    parser.add_argument(
        "--keep", action="store_true", help="leave the app deployed afterwards (and say its name)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    name, _, method = args.endpoint.partition("/")
    check_name("endpoint", name)
    kwargs = call_arguments(args)
    # A suffix keeps two runs of one file, and a deployed app of that name, apart.
    app = check_name(
        "app", f"{default_app_name(args.file)[:38].rstrip('-')}-{secrets.token_hex(4)}"
    )
    config = load_config()
    stop_on_signals()  # Ctrl+C and `kill` stop the app
    deployed = False
    try:
        names = {e["name"] for e in deploy(args.file, app, config)["endpoints"]}
        deployed = True
        if name not in names:
            raise InvalidError(
                f"{args.file} has no endpoint {name!r} (it has: {', '.join(sorted(names))})"
            )
        endpoint = Endpoint(make_label(app, name), config, method or FUNCTION_METHOD)
        with _replica_output(app, config):
            if args.stream:
                write_stream(endpoint.stream(**kwargs), args.output)
            else:
                write_result(endpoint.call(**kwargs), args.output)
    finally:
        if deployed and not args.keep:
            with admin_client(config) as client, contextlib.suppress(Exception):
                check(client.delete(f"/v1/apps/{app}"))
        elif deployed:
            print(f"app {app} is still deployed (`ember stop {app}` stops it)", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _replica_output(app: str, config: ClientConfig):  # type: ignore[no-untyped-def]
    """Print the app's replica output to stderr while the body runs."""
    stop = threading.Event()
    client = admin_client(config, timeout=None)

    def follow() -> None:
        # The app is new: all of its history is this run's, from before the follow began.
        params = {"tail": "100000", "follow": "1"}
        with (
            contextlib.suppress(httpx.HTTPError),
            client.stream("GET", f"/v1/apps/{app}/logs", params=params) as response,
        ):
            for line in response.iter_lines():
                if stop.is_set():
                    return
                if line.strip():
                    entry = json.loads(line)
                    if entry.get("stream") in SHOWN_STREAMS:
                        print(format_entry(entry), file=sys.stderr, flush=True)

    thread = threading.Thread(target=follow, name="ember-run-logs", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.wait(LAST_LINES_SECONDS)
        stop.set()
        client.close()  # ends the follow's read
        thread.join(timeout=5)
