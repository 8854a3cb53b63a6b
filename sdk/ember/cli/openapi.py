"""`ember openapi APP--ENDPOINT`: the OpenAPI document an endpoint serves at
`{URL}/openapi.json`, for client generators and API explorers."""

from __future__ import annotations

import argparse
import json

from ember.cli.common import admin_client, check, output_file
from ember.errors import InvalidError
from ember.labels import split_label


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "openapi",
        help="print an endpoint's OpenAPI document",
        description="Print the OpenAPI 3.1 document of a function or class endpoint: its "
        "methods, their arguments and results (from the code's type hints and "
        "docstrings), and its errors. The endpoint serves it at {URL}/openapi.json too, "
        "to whoever may call it.",
    )
    parser.add_argument("label", metavar="APP--ENDPOINT")
    parser.add_argument("-o", "--output", metavar="PATH", help="write it to PATH")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if split_label(args.label) is None:
        raise InvalidError(f"{args.label!r} is not a label; labels look like APP--ENDPOINT")
    with output_file(args.output) as output, admin_client() as client:
        document = check(client.get(f"/{args.label}/openapi.json"))
        text = json.dumps(document, indent=2) + "\n"
        if output is None:
            print(text, end="")
        else:
            output.write(text.encode())
    return 0
