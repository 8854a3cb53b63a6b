"""`ember replica ls|stop|exec`: the replicas that serve the endpoints, one by one, as
`kubectl get pods`, `kubectl delete pod` and `kubectl exec` show and reach containers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from ember.calling.client import error_from_response
from ember.cli.common import (
    add_all_workspaces,
    admin_client,
    app_name,
    check,
    listing_params,
    table,
    with_workspaces,
)
from ember.config import load_config
from ember.errors import InvalidError, NotFoundError
from ember.wire.labels import make_label, nearest_label, split_label


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "replica",
        help="list replicas, stop one, or run a command in one",
        description="The replicas (processes) that serve the endpoints: list them, stop "
        "one, or run a command in one to see what it sees. REPLICA is an id from "
        "`ember replica ls`, its first characters, or an endpoint's APP--ENDPOINT for its "
        "oldest ready replica.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "ls",
        help="list replicas",
        description="List the replicas, the oldest first: endpoint, version, node, state, "
        "inputs running and served, age, how it started, memory used.",
    )
    listing.add_argument("app", nargs="?", type=app_name, metavar="APP", help="only this app's")
    add_all_workspaces(listing)
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    listing.set_defaults(run=run_list)
    stop = actions.add_parser(
        "stop",
        help="stop a replica",
        description="Stop REPLICA: it takes no new inputs, finishes those it runs and "
        "exits (--now: it is killed at once and its inputs go back to the queue). The "
        "autoscaler starts another if the load needs one: use it on a replica that "
        "misbehaves, or to have one restored afresh.",
    )
    stop.add_argument("replica", metavar="REPLICA")
    stop.add_argument("--now", action="store_true", help="kill it at once")
    stop.set_defaults(run=run_stop)
    run_beside = actions.add_parser(
        "exec",
        help="run a command in a replica",
        description="Run COMMAND in REPLICA: inside its sandbox, as its user (a deploy "
        "token of its workspace may), in its folder (the deployed bundle), "
        "with its environment (its app's Python and pip first on PATH, its secrets, its "
        "GPUs) and within its memory_limit= and cpu_limit=. Its output is printed as it "
        "comes and its exit status is this command's. It reads no input (with -i, this "
        "command's standard input as it comes; with -t, the keys typed here, on a "
        "terminal of this window's size), and ends when "
        "the replica does or when this command is interrupted. In a sandboxed replica "
        "the replica is PID 1 there. For example: `ember replica exec r-3f2a -- pip "
        "list`, `... -- nvidia-smi`, `-it ... -- bash` (`ember profile` runs py-spy).",
    )
    run_beside.add_argument("replica", metavar="REPLICA")
    _exec_options(run_beside)
    run_beside.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    run_beside.set_defaults(run=run_exec)


def _exec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="kill the command after this long (exit status 124)",
    )
    parser.add_argument(
        "-i",
        "--stdin",
        action="store_true",
        help="send the command this command's standard input, as it comes: "
        "`-i -- python - < debug.py`",
    )
    parser.add_argument(
        "-t",
        "--tty",
        action="store_true",
        help="run it on a terminal of this window's size, every key going to it (a "
        "shell, a REPL, top): `-it -- bash`",
    )


def resolve(client: httpx.Client, text: str) -> dict[str, Any]:
    """The replica whose id is `text`, the only one whose id starts with it, or for an
    endpoint's label (APP--ENDPOINT or APP/ENDPOINT) its oldest ready replica."""
    replicas = check(client.get("/v1/replicas"))["replicas"]
    label = make_label(*text.split("/", 1)) if text.count("/") == 1 else text
    if split_label(label) is not None and not text.startswith("r-"):
        ready = [r for r in replicas if r["label"] == label and r["state"] == "ready"]
        if ready:
            return ready[0]  # the oldest: ember replica ls lists them oldest first
        check_endpoint(client, label)
        raise NotFoundError(
            404,
            "not_found",
            f"{label} has no ready replica now: call it, or keep one with "
            f"`ember scale {label} --min 1`",
        )
    exact = [r for r in replicas if r["id"] == text]
    matches = exact or [r for r in replicas if r["id"].startswith(text)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFoundError(
            404, "not_found", f"no replica {text} is running (`ember replica ls` lists them)"
        )
    ids = ", ".join(r["id"] for r in matches)
    raise InvalidError(f"{text} could be any of {ids}: give more of its id")


def check_endpoint(client: httpx.Client, label: str) -> None:
    """NotFoundError naming the nearest label there is, if no endpoint has `label`."""
    labels = {row["label"] for row in check(client.get("/v1/apps"))["endpoints"]}
    if label not in labels:
        near = nearest_label(label, labels)
        hint = f"; did you mean {near}?" if near else " (`ember ls` lists them)"
        raise NotFoundError(404, "not_found", f"no endpoint named {label}{hint}")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _row(replica: dict[str, Any], now: float) -> list[str]:
    started = "-"
    if replica.get("start_kind"):
        started = replica["start_kind"]
        if replica.get("start_seconds") is not None:
            started += f" {replica['start_seconds']:.2f} s"
    memory = replica.get("memory_bytes")
    return [
        replica["id"],
        replica["label"],
        f"v{replica['version']}" + (" (canary)" if replica.get("canary") else ""),
        replica.get("node") or "-",
        replica["state"],
        str(replica["running"]),
        str(replica["served"]),
        _age(max(0.0, now - replica["created_at"])),
        started,
        f"{memory / 2**20:.0f} MiB" if memory else "-",
    ]


def run_list(args: argparse.Namespace) -> int:
    with admin_client() as client:
        params = listing_params(args, {"app": args.app} if args.app else {})
        data = check(client.get("/v1/replicas", params=params))
    if args.json:
        print(json.dumps(data["replicas"], indent=2))
        return 0
    if not data["replicas"]:
        where = f" of app {args.app}" if args.app else ""
        print(f"no replicas{where} are running (endpoints with work, or min_replicas=, have some)")
        return 0
    header = ["REPLICA", "ENDPOINT", "VER", "NODE", "STATE", "RUNNING", "SERVED", "AGE"]
    header += ["STARTED", "MEMORY"]
    rows = [_row(r, data["now"]) for r in data["replicas"]]
    print(table(*with_workspaces(args, data["replicas"], rows, header)))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    with admin_client() as client:
        replica = resolve(client, args.replica)
        params = {"now": "1"} if args.now else {}
        result = check(client.delete(f"/v1/replicas/{replica['id']}", params=params))
    if result["state"] == "killed":
        print(f"replica {replica['id']} was killed; its inputs went back to the queue")
    elif result["state"] == "stopped":
        print(f"replica {replica['id']} was stopped before it was ready")
    else:
        print(f"replica {replica['id']} is stopping once its inputs are done ({result['state']})")
    return 0


def _command(args: argparse.Namespace) -> list[str]:
    """The command after REPLICA; options between REPLICA and `--` are exec's own (a
    `--` later in a command that starts at once is the command's)."""
    command = list(args.command)
    if command[:1] == ["--"] or (command[:1] and command[0].startswith("-") and "--" in command):
        split = command.index("--")
        options, command = command[:split], command[split + 1 :]
        if options:
            parser = argparse.ArgumentParser(prog="ember replica exec", add_help=False)
            _exec_options(parser)
            parser.parse_args(options, namespace=args)
    if not command:
        raise InvalidError(
            "name the command to run after the replica: ember replica exec REPLICA -- ls -l"
        )
    return command


def run_exec(args: argparse.Namespace) -> int:
    # Here, not at the top: websockets (exec_session's) is a twentieth of every ember
    # command's start-up, and only this one needs it.
    from ember.cli.ops.exec_session import run_interactive, show_event

    command = _command(args)
    if args.tty and not sys.stdin.isatty():
        raise InvalidError("-t needs a terminal to read keys from; pipe input with -i instead")
    body: dict[str, Any] = {"command": command, "timeout": args.timeout}
    with admin_client(timeout=None) as client:
        replica = resolve(client, args.replica)
        if args.stdin or args.tty:
            config = load_config()
            return run_interactive(config, replica["id"], command, args.timeout, args.tty)
        url = f"/v1/replicas/{replica['id']}/exec"
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raise error_from_response(response.status_code, response.read())
            for line in response.iter_lines():
                code = show_event(json.loads(line)) if line else None
                if code is not None:
                    return code
    print("ember replica exec: the answer ended before the command did", file=sys.stderr)
    return 1
