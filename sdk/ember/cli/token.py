"""`ember token create`: mint a bearer token (shown once; stored hashed)."""

from __future__ import annotations

import argparse

from ember.cli.common import admin_client, check


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("token", help="manage API tokens", description="Manage tokens.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser(
        "create",
        help="create a token",
        description="Create a token. invoke: call endpoints; worker: join as a worker node; "
        "metrics: read /metrics (for Prometheus); admin: everything. The token is printed "
        "once and stored only as a hash.",
    )
    create.add_argument(
        "--scope", choices=["invoke", "worker", "metrics", "admin"], default="invoke"
    )
    create.add_argument("--name", default="", help="a note to recognise the token by")
    create.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with admin_client() as client:
        result = check(
            client.post("/v1/tokens", json={"scope": args.scope, "name": args.name}), (201,)
        )
    print(result["token"])
    return 0
