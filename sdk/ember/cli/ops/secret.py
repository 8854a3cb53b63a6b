"""`ember secret set|ls|rm`: named sets of environment variables for endpoints'
replicas (`@ember.endpoint(secrets=["name"])`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from ember.cli.common import admin_client, ago, check, table
from ember.declarations.settings import check_name
from ember.errors import InvalidError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "secret",
        help="manage secrets for endpoints",
        description="Secrets are named sets of environment variables. An endpoint that "
        "names one in @ember.endpoint(secrets=[...]) gets its variables in every replica's "
        "environment. Values are never shown again.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    put = actions.add_parser(
        "set",
        help="create or replace a secret",
        description="Create or replace the secret NAME. Replicas started from then on get "
        "the new values (running ones keep theirs; snapshots taken with old values are "
        "dropped). KEY=- reads that value from standard input; a bare KEY takes the value "
        "of this shell's environment variable KEY.",
    )
    put.add_argument("name", metavar="NAME")
    put.add_argument("pairs", nargs="*", metavar="KEY=VALUE | KEY")
    put.add_argument(
        "--from-dotenv",
        type=Path,
        metavar="FILE",
        help="read KEY=VALUE lines from a .env file too (# comments, optional quotes)",
    )
    put.set_defaults(run=run_set)
    listing = actions.add_parser(
        "ls", help="list secrets", description="List secrets: names, keys and users."
    )
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    remove = actions.add_parser(
        "rm",
        help="delete a secret",
        description="Delete a secret that no deployed endpoint uses.",
    )
    remove.add_argument("name", metavar="NAME")
    remove.set_defaults(run=run_remove)


def parse_pair(text: str, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """KEY=VALUE, or a bare KEY for the value this shell's environment gives it (as
    `docker run -e KEY` takes it), so the value is never typed on a command line."""
    key, sep, value = text.partition("=")
    if not key:
        raise InvalidError(f"{text!r} is not KEY=VALUE")
    if not sep:
        environ = os.environ if environ is None else environ
        if key not in environ:
            raise InvalidError(
                f"{key} is not KEY=VALUE, and this shell's environment has no {key} to take "
                "its value from"
            )
        return key, environ[key]
    return key, value


def parse_dotenv(text: str) -> dict[str, str]:
    """KEY=VALUE lines; blank lines, comments and a leading `export` are skipped, and a
    value in matching quotes loses them."""
    values = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").lstrip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise InvalidError(f"line {number} of the .env file is not KEY=VALUE")
        values[key.strip()] = _dotenv_value(value)
    return values


def _dotenv_value(text: str) -> str:
    """A value in matching quotes loses them (and keeps any #); an unquoted one loses
    an inline comment, a # after a space, as python-dotenv reads it."""
    value = text.strip()
    if value[:1] in ("'", '"'):
        end = value.find(value[0], 1)
        rest = value[end + 1 :].strip() if end != -1 else None
        if rest is not None and (not rest or rest.startswith("#")):
            return value[1:end]
    comment = re.search(r"\s#", value)
    return value[: comment.start()].rstrip() if comment else value


def run_set(args: argparse.Namespace) -> int:
    check_name("secret", args.name)
    values: dict[str, str] = {}
    if args.from_dotenv is not None:
        try:
            values.update(parse_dotenv(args.from_dotenv.read_text()))
        except OSError as exc:
            raise InvalidError(f"cannot read {args.from_dotenv}: {exc.strerror}") from None
    from_stdin = [pair for pair in args.pairs if pair.endswith("=-")]
    if len(from_stdin) > 1:
        raise InvalidError(
            f"{' and '.join(from_stdin)}: only one value can come from standard input"
        )
    for pair in args.pairs:
        key, value = parse_pair(pair)
        if value == "-":
            value = sys.stdin.read().rstrip("\n")
        values[key] = value
    if not values:
        raise InvalidError("give at least one KEY=VALUE (or --from-dotenv FILE)")
    with admin_client() as client:
        result = check(client.put(f"/v1/secrets/{args.name}", json={"values": values}), (200, 201))
    keys = ", ".join(sorted(values))
    print(f"{'created' if result['created'] else 'updated'} secret {args.name} ({keys})")
    if result["used_by"] and not result["created"]:
        users = ", ".join(result["used_by"])
        print(f"replicas of {users} started from now on get it (running ones keep theirs)")
    return 0


def run_list(args: argparse.Namespace) -> int:
    with admin_client() as client:
        secrets = check(client.get("/v1/secrets"))["secrets"]
    if args.json:
        print(json.dumps(secrets, indent=2))
        return 0
    if not secrets:
        print("no secrets; `ember secret set NAME KEY=VALUE` creates one")
        return 0
    rows = [
        [
            s["name"],
            ", ".join(s["keys"]),
            ago(s["updated_at"]),
            ", ".join(s["used_by"]) or "-",
        ]
        for s in secrets
    ]
    print(table(rows, ["NAME", "KEYS", "UPDATED", "USED BY"]))
    return 0


def run_remove(args: argparse.Namespace) -> int:
    check_name("secret", args.name)
    with admin_client() as client:
        check(client.delete(f"/v1/secrets/{args.name}"))
    print(f"deleted secret {args.name}")
    return 0
