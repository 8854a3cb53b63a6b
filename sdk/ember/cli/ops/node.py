"""`ember node ls|drain|uncordon`: the worker nodes, and taking one out of service for
maintenance without failing a call."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from ember.cli.common import admin_client, byte_size, check, table
from ember.declarations.node_labels import format_labels
from ember.errors import InvalidError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "node",
        help="list worker nodes, or drain one for maintenance",
        description="The worker nodes that joined the platform (`ember worker`), and taking "
        "one out of service: a draining node keeps serving the inputs its replicas run, "
        "then they stop, and new replicas go to other nodes.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "ls",
        help="list the nodes",
        description="List the nodes: their state, replicas, capacity and labels, and what "
        "their caches hold (bytes of weights, snapshot images), which draws replicas there.",
    )
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    drain = actions.add_parser(
        "drain",
        help="stop placing replicas on a node and let its replicas finish and stop",
        description="Take NODE out of service until `ember node uncordon NODE` (across "
        "restarts of the control plane): its replicas take no new inputs, finish those "
        "they run and stop; replacements start on other nodes, and calls wait for one if "
        "none can run them. Add --wait to return once the node runs no replica.",
    )
    drain.add_argument("name", metavar="NODE")
    drain.add_argument(
        "--wait", action="store_true", help="return once no replica is left on the node"
    )
    drain.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS", help="with --wait (600)"
    )
    drain.set_defaults(run=run_drain)
    uncordon = actions.add_parser(
        "uncordon",
        help="let a drained node, or a GPU fenced for its health, take replicas again",
        description="New replicas may be placed on NODE again; with --gpu, on that GPU of "
        "NODE, which its NVML watch fenced (fenced again at once if its condition persists).",
    )
    uncordon.add_argument("name", metavar="NODE")
    uncordon.add_argument("--gpu", type=gpu_index, metavar="N", help="the fenced GPU's index")
    uncordon.set_defaults(run=run_uncordon)


def gpu_index(text: str) -> int:
    """`--gpu N`: a GPU's index on its node, from 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a GPU's index is a number from 0, not {text!r}")
    return int(text)


def gpu_health(gpus: list[dict[str, Any]]) -> str:
    """The GPUs' health in a few words: counts by state, and each fenced GPU's reasons."""
    if not gpus:
        return "-"
    counts: dict[str, int] = {}
    for gpu in gpus:
        counts[gpu["state"]] = counts.get(gpu["state"], 0) + 1
    words = [f"{n} {state}" for state, n in counts.items()]
    words += [
        f"GPU {gpu['index']} fenced: {'; '.join(gpu.get('reasons') or ['failed'])}"
        for gpu in gpus
        if gpu.get("fenced")
    ]
    return ", ".join(words)


def _row(node: dict[str, Any]) -> list[str]:
    gpus = ", ".join(f"{n}x{kind}" for kind, n in node["gpus"].items()) or "-"
    return [
        node["name"],
        "draining" if node.get("draining") else "ready",
        str(node.get("replicas", 0)),
        f"{node['cpu']:g}",
        f"{node['memory'] // 1024} GiB",
        gpus,
        gpu_health(node.get("gpu_health") or []),
        format_labels(node.get("labels") or {}) or "-",
        byte_size(cached) if (cached := node.get("weights_cached_bytes")) else "-",
        str(node.get("snapshots_cached", 0)),
    ]


def run_list(args: argparse.Namespace) -> int:
    with admin_client() as client:
        nodes = check(client.get("/v1/apps"))["workers"]
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    if not nodes:
        print("no worker nodes; join one with `ember worker --server URL --token T`")
        return 0
    header = ["NODE", "STATE", "REPLICAS", "CPU", "MEMORY", "GPUS", "GPU HEALTH", "LABELS"]
    header += ["WEIGHTS", "IMAGES"]
    print(table([_row(node) for node in nodes], header))
    return 0


def run_drain(args: argparse.Namespace) -> int:
    with admin_client() as client:
        result = check(client.post(f"/v1/nodes/{args.name}/drain"))
        print(f"node {args.name} is draining: {result['draining_replicas']} replica(s) to stop")
        if not args.wait:
            return 0
        deadline = time.monotonic() + args.timeout
        while True:
            nodes = check(client.get("/v1/apps"))["workers"]
            left = sum(n.get("replicas", 0) for n in nodes if n["name"] == args.name)
            if not left:
                print(f"node {args.name} runs no replica; it may be stopped")
                return 0
            if time.monotonic() > deadline:
                print(f"node {args.name} still runs {left} replica(s) after {args.timeout:g} s")
                return 1
            time.sleep(0.5)


def run_uncordon(args: argparse.Namespace) -> int:
    if args.gpu is not None:
        with admin_client() as client:
            check_node_known(client, args.name)
            check(client.post(f"/v1/nodes/{args.name}/gpus/{args.gpu}/uncordon"))
        print(f"GPU {args.gpu} of node {args.name} takes new replicas again")
        return 0
    with admin_client() as client:
        response = client.post(f"/v1/nodes/{args.name}/uncordon")
        if response.status_code == 409:
            # "not draining" is true of a name no node has too: say which it is.
            check_node_known(client, args.name)
        check(response)
    print(f"node {args.name} takes new replicas again")
    return 0


def check_node_known(client: httpx.Client, name: str) -> None:
    """InvalidError when no worker node of that name has joined."""
    names = sorted({node["name"] for node in check(client.get("/v1/apps"))["workers"]})
    if name not in names:
        raise InvalidError(f"no worker node named {name} (nodes: {', '.join(names) or 'none'})")
