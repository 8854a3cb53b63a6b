"""`ember profile APP--ENDPOINT`: where a replica spends its time, from py-spy run by its
worker against the replica's process: a flame graph (SVG) or a speedscope file of its
Python (and native) stacks over some seconds, or with `--dump` every thread's stack once.
The host-side bottleneck (tokenizing, batching, a copy, the GIL) shows before any kernel
is worth writing."""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from ember.calling.client import error_from_response
from ember.cli.common import admin_client
from ember.cli.ops.replica import check_endpoint, resolve
from ember.errors import InvalidError
from ember.wire.labels import meant_label

FORMATS = ("flamegraph", "speedscope")
SUFFIXES = {"flamegraph": ".svg", "speedscope": ".speedscope.json"}


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "profile",
        help="profile a replica with py-spy: a flame graph or a stack dump",
        description="Record where a replica of APP--ENDPOINT spends its time: its worker "
        "runs py-spy against the replica's process for --duration seconds and this "
        "command writes the result as an SVG flame graph (open it in a browser) or a "
        "speedscope JSON (https://www.speedscope.app). With --dump, print every thread's "
        "stack once instead. Python frames and, where py-spy can unwind them, native "
        "ones (C, C++, Cython). Works on restored replicas and inside their sandbox; "
        "needs an admin token. The replica is the endpoint's oldest ready one, or "
        "--replica's.",
    )
    parser.add_argument("label", metavar="APP--ENDPOINT")
    parser.add_argument(
        "--replica", metavar="REPLICA", help="this replica (an id from `ember replica ls`)"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to record (default: 10; at most 600)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="PATH",
        help="where to write it (default: APP--ENDPOINT.svg, or .speedscope.json)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="flamegraph (SVG) or speedscope (JSON); default: from -o's suffix "
        "(.json: speedscope), else flamegraph",
    )
    parser.add_argument(
        "--dump", action="store_true", help="print every thread's stack once, and stop"
    )
    parser.add_argument(
        "--rate", type=int, default=100, metavar="N", help="samples a second (default: 100)"
    )
    parser.add_argument(
        "--no-native", action="store_true", help="Python frames only (no native unwinding)"
    )
    parser.set_defaults(run=run)


def profile_format(chosen: str | None, output: Path | None) -> str:
    """The format asked for, else the one -o's name says, else a flame graph."""
    if chosen is not None:
        return chosen
    return "speedscope" if output is not None and output.suffix == ".json" else "flamegraph"


def run(args: argparse.Namespace) -> int:
    label = meant_label(args.label)
    fmt = profile_format(args.format, args.output)
    output = args.output or Path(label + SUFFIXES[fmt])
    body: dict[str, Any] = {
        "mode": "dump" if args.dump else "record",
        "duration": args.duration,
        "format": fmt,
        "native": not args.no_native,
        "rate": args.rate,
    }
    with admin_client(timeout=None) as client:
        replica = _replica(client, label, args.replica)
        if not args.dump:
            print(
                f"profiling replica {replica['id']} of {label} for {args.duration:g} s ...",
                file=sys.stderr,
                flush=True,
            )
        url = f"/v1/replicas/{replica['id']}/profile"
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raise error_from_response(response.status_code, response.read())
            if args.dump:
                return _relay(response, None)
            partial = output.with_name(f".{output.name}.{os.getpid()}.part")
            try:
                with partial.open("wb") as file:
                    code = _relay(response, file)
                if code == 0:
                    partial.replace(output)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    partial.unlink()
    if code == 0:
        size = output.stat().st_size
        print(f"wrote {output} ({size / 1024:.0f} KiB, {fmt})", file=sys.stderr)
    return code


def _replica(client: httpx.Client, label: str, named: str | None) -> dict[str, Any]:
    """The replica to profile: --replica's (of this endpoint), or the endpoint's oldest
    ready one; an unknown label's error names the nearest one there is."""
    check_endpoint(client, label)
    replica = resolve(client, named or label)
    if replica["label"] != label:
        raise InvalidError(f"replica {replica['id']} serves {replica['label']}, not {label}")
    return replica


def _relay(response: httpx.Response, file: Any) -> int:
    """Write the profile's output to `file` (stdout when None) and py-spy's notes to
    stderr; its exit status (1 when it could not run or was stopped)."""
    out = file if file is not None else sys.stdout.buffer
    for line in response.iter_lines():
        if not line:
            continue
        event = json.loads(line)
        if "data" in event:
            data = base64.b64decode(event["data"])
            if event.get("stream") == "stderr":
                sys.stderr.buffer.write(data)
                sys.stderr.flush()
            else:
                out.write(data)
            continue
        if event.get("error"):
            print(f"ember profile: {event['error']}", file=sys.stderr)
        code = event.get("exit_code")
        return 1 if code is None else int(code)
    print("ember profile: the answer ended before the profile did", file=sys.stderr)
    return 1
