"""`ember openapi APP--ENDPOINT`: the OpenAPI document an endpoint serves at
`{URL}/openapi.json`, for client generators and API explorers."""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from ember.cli.common import admin_client, check, output_file
from ember.config import load_config
from ember.errors import InvalidError
from ember.wire.labels import checked_label, label_in


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "openapi",
        help="print an endpoint's OpenAPI document",
        description="Print the OpenAPI 3.1 document of a function or class endpoint: its "
        "methods, their arguments and results (from the code's type hints and "
        "docstrings), and its errors. The endpoint serves it at {URL}/openapi.json too, "
        "to whoever may call it. A web app (@ember.asgi_app, @ember.wsgi_app) has none "
        "from the platform: it describes its own API, if at all (FastAPI at "
        "{URL}/openapi.json, which this prints when the app serves it).",
    )
    parser.add_argument("label", metavar="APP--ENDPOINT")
    parser.add_argument("-o", "--output", metavar="PATH", help="write it to PATH")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    checked_label(args.label)
    config = load_config()
    label = label_in(config.workspace, args.label)
    with output_file(args.output) as output, admin_client(config) as client:
        response = client.get(f"/{label}/openapi.json")
        if _json(response) is None and _is_web_app(client, label):
            raise InvalidError(
                f"{args.label} is a web app, which serves its own API description if it has "
                f"one (a FastAPI app's is at its URL's /openapi.json, where this one answered "
                f"{response.status_code}); the platform makes OpenAPI documents only for "
                "function and class endpoints"
            )
        document = check(response)
        text = json.dumps(document, indent=2) + "\n"
        if output is None:
            print(text, end="")
        else:
            output.write(text.encode())
    return 0


def _json(response: httpx.Response) -> Any:
    """The JSON of a 200 answer, else None."""
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:  # a web app's page that is not JSON
        return None


def _is_web_app(client: httpx.Client, label: str) -> bool:
    """Whether `label` is a deployed web app (False when the platform will not say)."""
    answer = client.get("/v1/apps")
    if answer.status_code != 200:
        return False
    endpoints = answer.json().get("endpoints", [])
    return any(row.get("label") == label and row.get("kind") == "asgi" for row in endpoints)
