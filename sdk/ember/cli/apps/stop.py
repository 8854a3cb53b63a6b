"""`ember stop APP`: stop every endpoint of an app; replicas finish their inputs first."""

from __future__ import annotations

import argparse

from ember.cli.common import admin_client, app_name, check


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("stop", help="stop an app", description="Stop an app's endpoints.")
    parser.add_argument("app", type=app_name, metavar="APP")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with admin_client() as client:
        result = check(client.delete(f"/v1/apps/{args.app}"))
    print(f"stopped app {result['app']} ({result['stopped_endpoints']} endpoints)")
    return 0
