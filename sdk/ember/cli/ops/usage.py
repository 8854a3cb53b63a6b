"""`ember usage [APP]`: what each endpoint's replicas held over a period."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ember.cli.common import (
    add_all_workspaces,
    admin_client,
    app_name,
    check,
    duration,
    listing_params,
    table,
    with_workspaces,
)
from ember.wire.labels import app_key, make_label


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "usage",
        help="show what the endpoints' replicas used",
        description="Per endpoint, over the last --since (a day by default, up to 31 days): "
        "how many replicas ran and for how long, the CPU-, memory- and GPU-hours they "
        "reserved (what `cpu=`, `memory=` and `gpu=` ask for, times their life), their "
        "starts by kind, and the inputs they finished.",
    )
    parser.add_argument("app", nargs="?", type=app_name, metavar="APP")
    parser.add_argument(
        "--since", type=duration, default=86_400.0, metavar="AGE", help="30m, 12h, 7d (1d)"
    )
    add_all_workspaces(parser)
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.set_defaults(run=run)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.3f}"


def usage_row(row: dict[str, Any]) -> list[str]:
    gpus = ", ".join(f"{hours(s)} {kind}" for kind, s in row["gpu_seconds"].items()) or "-"
    starts = ", ".join(f"{n} {kind}" for kind, n in row["starts"].items()) or "-"
    return [
        make_label(app_key(row["workspace"], row["app"]), row["endpoint"]),  # its label
        str(row["replicas"]),
        hours(row["replica_seconds"]),
        hours(row["cpu_seconds"]),
        hours(row["gib_seconds"]),
        gpus,
        starts,
        str(row["inputs"]),
    ]


def run(args: argparse.Namespace) -> int:
    params = listing_params(args, {"since": f"{args.since:.0f}"})
    if args.app:
        params["app"] = args.app
    with admin_client() as client:
        data = check(client.get("/v1/usage", params=params))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    endpoints = data["endpoints"]
    rows = [usage_row(row) for row in endpoints]
    if not rows:
        print("no replicas ran in that time")
        return 0
    header = ["ENDPOINT", "REPLICAS", "HOURS", "CPU-H", "GIB-H", "GPU-H", "STARTS", "INPUTS"]
    if data.get("prices"):
        header.append("COST")
        for row, endpoint in zip(rows, endpoints, strict=True):
            row.append(f"{endpoint['cost']:.4f}")
    print(table(*with_workspaces(args, endpoints, rows, header)))
    tokens = token_rows(endpoints, priced=bool(data.get("prices")))
    if tokens:
        print()
        head = ["ENDPOINT", "TRAFFIC", "REQUESTS", "IN TOKENS", "OUT TOKENS"]
        if data.get("prices"):
            head += ["COST", "COST/M OUT", "M TOKENS/UNIT"]
        print(table(tokens, head))
    return 0


def token_rows(endpoints: list[dict[str, Any]], priced: bool) -> list[list[str]]:
    """LLM endpoints' tokens, online and batch apart, with their cost where priced."""
    rows = []
    for endpoint in endpoints:
        label = make_label(app_key(endpoint["workspace"], endpoint["app"]), endpoint["endpoint"])
        for traffic, counted in endpoint.get("tokens", {}).items():
            row = [
                label,
                traffic,
                str(counted["requests"]),
                f"{counted['input']:,}",
                f"{counted['output']:,}",
            ]
            if priced:
                cost = endpoint["by_traffic"][traffic]
                per_million = cost["cost_per_million_output_tokens"]
                per_unit = cost["million_tokens_per_unit"]
                row += [
                    f"{cost['cost']:.4f}",
                    "-" if per_million is None else f"{per_million:.4f}",
                    "-" if per_unit is None else f"{per_unit:.2f}",
                ]
            rows.append(row)
    return rows
