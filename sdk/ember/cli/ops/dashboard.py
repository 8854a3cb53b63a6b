"""`ember dashboard`: open the dashboard, signed in, with a one-time login link."""

from __future__ import annotations

import argparse
import os
import sys
import webbrowser

from ember.cli.common import admin_client, check
from ember.config import load_config


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "dashboard",
        help="open the dashboard in a browser, signed in",
        description="Asks the server for a one-time login link (it works once, within a "
        "minute) and opens it in the default browser: the browser then keeps a session "
        "cookie (8 hours at most, and never past this token's expiry) with this token's "
        "scope and workspace, across tabs and reloads. Needs a deploy or admin token.",
    )
    parser.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="only print the link (for a browser on another machine)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load_config()
    with admin_client(config) as client:
        link = check(client.post("/v1/dashboard/links"), (201,))
    url = config.server_url.rstrip("/") + link["path"]
    if not args.print_only and _has_screen() and webbrowser.open(url):
        print("opened the dashboard in your browser (the link works once, for a minute)")
        return 0
    print(url)
    print("(works once, within a minute)")
    return 0


def _has_screen() -> bool:
    """Whether a graphical browser can open here: on a server (no display) Python would
    start a text browser in this terminal instead, so the link is printed."""
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
