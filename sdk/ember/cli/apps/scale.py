"""`ember scale APP--ENDPOINT --min 2`: change an endpoint's autoscaling until its next
deploy, without one (replicas for a launch, a lower cap while a quota runs out)."""

from __future__ import annotations

import argparse
from typing import Any

from ember.cli.common import admin_client, check
from ember.errors import InvalidError
from ember.wire.labels import checked_label, make_label

# CLI flag -> setting
FLAGS = {
    "min": "min_replicas",
    "max": "max_replicas",
    "buffer": "buffer_replicas",
    "scaledown_window": "scaledown_window",
}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "scale",
        help="change an endpoint's autoscaling until its next deploy",
        description="Change an endpoint's autoscaling settings without a deploy: they hold "
        "for the version that serves, across control-plane restarts, until `--reset` or "
        "the app's next deploy (or rollback), whose code says what it wants. Without "
        "options, print the settings in force.",
    )
    parser.add_argument("label", metavar="APP--ENDPOINT", help="or APP/ENDPOINT")
    parser.add_argument("--min", type=int, metavar="N", help="min_replicas: replicas kept ready")
    parser.add_argument("--max", type=int, metavar="N", help="max_replicas: the most at once")
    parser.add_argument(
        "--buffer", type=int, metavar="N", help="buffer_replicas: idle ones kept while busy"
    )
    parser.add_argument(
        "--scaledown-window", type=float, metavar="S", help="seconds idle before scaling down"
    )
    parser.add_argument(
        "--reset", action="store_true", help="back to the deployed settings (with no options)"
    )
    parser.set_defaults(run=run)


def endpoint_label(text: str) -> str:
    """APP--ENDPOINT, also from APP/ENDPOINT, checked before it goes into a URL path."""
    if "/" in text:
        app, _, endpoint = text.partition("/")
        text = make_label(app, endpoint)
    checked_label(text)
    return text


def describe(answer: dict[str, Any]) -> str:
    lines = [f"{answer['label']} (version {answer['version']}):"]
    for name, value in answer["settings"].items():
        deployed = answer["deployed"][name]
        note = f"  (deployed: {deployed:g})" if name in answer["override"] else ""
        lines.append(f"  {name:<17} {value:g}{note}")
    if answer["override"]:
        lines.append("until the next deploy, or `ember scale --reset`")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    label = endpoint_label(args.label)
    change = {
        setting: getattr(args, flag)
        for flag, setting in FLAGS.items()
        if getattr(args, flag) is not None
    }
    if args.reset and change:
        raise InvalidError("--reset goes alone: it drops every change")
    with admin_client() as client:
        path = f"/v1/endpoints/{label}/scaling"
        if args.reset:
            answer = check(client.delete(path))
        elif change:
            answer = check(client.patch(path, json=change))
        else:
            answer = check(client.get(path))
    print(describe(answer))
    return 0
