"""`ember image ls|rm`: the images workers have built (`ember.Image`), as the control
plane's store holds them: their layers and size, and dropping one (its layers that no
other built image shares go too; its next build builds them again)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from ember.cli.common import admin_client, ago, check, table
from ember.errors import InvalidError

PREFIX = re.compile(r"(sha256:)?[0-9a-f]{6,64}\Z")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "image",
        help="list built images, or drop one",
        description="The images (ember.Image) that worker nodes have built, each layer "
        "stored once in the control plane's blob store.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "ls",
        help="list built images",
        description="List the built images, the newest first: digest, steps, layers, "
        "the size of their layer tars and when the build finished.",
    )
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    drop = actions.add_parser(
        "rm",
        help="drop a built image",
        description="Drop the image whose digest starts with DIGEST (6 hex digits or "
        "more), and its layers that no other built image shares; nodes drop their "
        "copies of it that no replica uses. Its next build builds those again.",
    )
    drop.add_argument(
        "digest", metavar="DIGEST", help="the image's digest, or its first characters"
    )
    drop.set_defaults(run=run_drop)


def _row(image: dict[str, Any]) -> list[str]:
    return [
        image["digest"][7:19],
        " ".join(image["steps"]),
        str(image["layers"]),
        f"{image['size'] / 1e6:.1f} MB",
        ago(image["built_at"]),
    ]


def run_list(args: argparse.Namespace) -> int:
    with admin_client() as client:
        images = check(client.get("/v1/images"))["images"]
    if args.json:
        print(json.dumps(images, indent=2))
    elif images:
        print(table([_row(i) for i in images], ["IMAGE", "STEPS", "LAYERS", "SIZE", "BUILT"]))
    else:
        print("no images built")
    return 0


def run_drop(args: argparse.Namespace) -> int:
    if not PREFIX.match(args.digest):
        raise InvalidError(f"{args.digest!r} is not an image digest (or its first 6+ hex digits)")
    wanted = args.digest.removeprefix("sha256:")
    with admin_client() as client:
        images = check(client.get("/v1/images"))["images"]
        matches = [i for i in images if i["digest"][7:].startswith(wanted)]
        if not matches:
            raise InvalidError(f"no built image {args.digest} (`ember image ls` lists them)")
        if len(matches) > 1:
            found = ", ".join(i["digest"][7:19] for i in matches)
            raise InvalidError(f"{args.digest} could be any of {found}: give more of it")
        result = check(client.delete(f"/v1/images/{matches[0]['digest']}"))
    dropped = result["layers_dropped"]
    print(
        f"dropped image {result['digest'][7:19]} and {dropped} layer{'s' * (dropped != 1)} "
        "no other image shares"
    )
    return 0
