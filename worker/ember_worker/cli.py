"""Command line of the worker agent, shared by `ember worker` and `python -m ember_worker`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ember.calling import eventloop
from ember.cli.common import node_label, positive_number
from ember.config import load_config
from ember.errors import EmberError
from ember_worker.images.build_steps import BUILD_UIDS
from ember_worker.images.debian_base import BASE_ACCOUNT, SUBUID, subordinate_ids
from ember_worker.log_limits import DEFAULT_BURST_KIB, DEFAULT_RATE_KIB, LogLimit
from ember_worker.model_dirs import model_dir, overlap_problem
from ember_worker.networks.namespaces import NET_UIDS
from ember_worker.processes.process_env import REPLICA_ENV_ENV, check_passed_name
from ember_worker.processes.replica_users import DEFAULT_FIRST_UID, DEFAULT_UID_COUNT, parse_range

WORKER_TOKEN_ENV = "EMBER_WORKER_TOKEN"

if TYPE_CHECKING:
    from ember_worker.agent.config import AgentConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        required=True,
        help="control plane URL, e.g. https://cp:8443; several processes of one platform "
        "comma-separated (https://a:8443,https://b:8443), tried in turn",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="a worker or admin token: visible to every user of this machine in `ps`, so "
        "prefer $EMBER_WORKER_TOKEN or --token-file; create one with "
        "`ember token create --scope worker`",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a file holding the worker's token (default: $EMBER_WORKER_TOKEN)",
    )
    parser.add_argument(
        "--ca-cert",
        default=os.environ.get("EMBER_CA_CERT"),
        help="PEM file of the control plane's CA: copy <state-dir>/ca.pem from the server "
        "(default: $EMBER_CA_CERT, or the CA of this machine's client config for that server)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path.home() / ".ember" / "worker",
        help="where bundles and replica files live (default: ~/.ember/worker)",
    )
    parser.add_argument(
        "--name", default=socket.gethostname(), help="node name shown in `ember ls`"
    )
    parser.add_argument("--cpu", type=float, default=None, help="CPUs to offer (default: all)")
    parser.add_argument("--memory", type=int, default=None, help="MiB to offer (default: all)")
    parser.add_argument(
        "--gpus",
        default=None,
        help="GPUs to offer, e.g. H100:8 or none (default: the NVIDIA GPUs nvidia-smi lists). "
        "Each replica sees only the GPUs it holds",
    )
    parser.add_argument(
        "--lazy-restore",
        action="store_true",
        help="let a restored replica run before its memory is all back: CRIU's lazy-pages "
        "daemon hands over each page on first touch and the rest in the background "
        "(needs userfaultfd). Faster to a running process, the same to a first answer, "
        "and the replica is killed if the daemon fails (default: copy all memory first)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="restore replicas' dense memory (weights, buffers) into 2 MiB transparent huge "
        "pages: up to 3x faster restores where the kernel has huge pages at hand, slower "
        "on a VM whose host takes free memory back (virtio-balloon free page reporting); "
        "bench/restore_fill.py tells which. Needs the CRIU that infra/criu.sh builds "
        "(default: 4 KiB pages)",
    )
    parser.add_argument(
        "--no-fetch-ahead",
        action="store_true",
        help="do not fetch published snapshot images, and the weights files they map, "
        "before a replica here needs one (for a node with a metered network or little "
        "disk); the first restore of each downloads it then (default: fetch each that "
        "fits in its cache beside the others)",
    )
    parser.add_argument(
        "--snapshot-cache-gb",
        type=positive_number,
        default=20.0,
        metavar="GB",
        help="disk for snapshot images on this node; the least recently used go first "
        "(default: 20)",
    )
    parser.add_argument(
        "--weights-cache-gb",
        type=positive_number,
        default=50.0,
        metavar="GB",
        help="disk for the weights its replicas read, shared by them; the least recently "
        "used objects go first (default: 50)",
    )
    parser.add_argument(
        "--label",
        action="append",
        type=node_label,
        default=[],
        metavar="KEY=VALUE",
        help="a label of this node (repeatable), e.g. --label zone=eu-west: endpoints with "
        "node_labels= run only on nodes that carry all of theirs",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=positive_number,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl+C, how long its replicas may take to finish the inputs "
        "they run (the control plane sends them no new ones) before they are stopped; "
        "a second signal stops them at once (default: 30)",
    )
    parser.add_argument(
        "--volume-cache-gb",
        type=positive_number,
        default=50.0,
        metavar="GB",
        help="disk for the copies of ember.Volume folders its replicas use; copies of apps "
        "with no replica here go first, the least recently synced first (default: 50)",
    )
    parser.add_argument(
        "--bundle-cache-gb",
        type=positive_number,
        default=2.0,
        metavar="GB",
        help="disk for extracted app bundles; past it, those no replica here starts or "
        "runs go, the least recently used first (default: 2)",
    )
    parser.add_argument(
        "--image-roots-gb",
        type=positive_number,
        default=20.0,
        metavar="GB",
        help="disk for images' roots extracted here (lazy mounts take none); past it, those "
        "no replica here starts or runs go, the least recently used first; as much again "
        "for the layers its image builds unpack (default: 20)",
    )
    parser.add_argument(
        "--channel-socket",
        default=None,
        metavar="NAME",
        help="a Unix socket of a control plane on this machine (@NAME: an abstract one) "
        "for the channels of this worker and its replicas, instead of TCP and TLS. "
        "`ember server` passes its own to its local worker",
    )
    parser.add_argument(
        "--replica-channel-socket",
        default=None,
        metavar="PATH",
        help="a Unix socket file of a control plane on this machine that sandboxed "
        "replicas, in networks of their own, open their channels over (mounted into "
        "each sandbox), instead of TCP and TLS. `ember server` passes its own",
    )
    parser.add_argument(
        "--replica-uids",
        type=_uid_range,
        default=(DEFAULT_FIRST_UID, DEFAULT_UID_COUNT),
        metavar="FIRST:COUNT",
        help="the uids replicas run as, one per workspace, when the worker runs as root; "
        "no account of the machine may use them "
        f"(default: {DEFAULT_FIRST_UID}:{DEFAULT_UID_COUNT})",
    )
    parser.add_argument(
        "--replica-pids-max",
        type=int,
        default=4096,
        metavar="N",
        help="the processes and threads each replica may have at once (its cgroup's "
        "pids.max), so that a fork bomb stays inside its replica (default: 4096)",
    )
    parser.add_argument(
        "--model-dir",
        action="append",
        type=_model_dir,
        default=[],
        metavar="DIR",
        help="a folder of this node that replicas may read, such as weights they open by "
        "file:// URL (repeatable): shown read-only, at its own path, in the sandbox of "
        "every replica of every workspace, so put there only what all may read, readable "
        "by others. A sandboxed replica sees no other folder of the node's",
    )
    parser.add_argument(
        "--replica-env",
        action="append",
        type=_passed_name,
        default=_passed_by_default(),
        metavar="NAME",
        help="a variable of this worker's environment to hand on to every replica of "
        "every workspace (repeatable; default: the names in EMBER_REPLICA_ENV, separated "
        "by ':'). Nothing else of the worker's environment reaches a replica: its S3 or "
        "database credentials stay here",
    )
    parser.add_argument(
        "--replica-loopback-port",
        action="append",
        type=_port,
        default=[],
        metavar="PORT",
        help="a port of this node's loopback that sandboxed replicas may reach on their "
        "own 127.0.0.1 (repeatable): a model store or cache the operator runs on the "
        "node. Nothing else of the node's loopback is reachable from a replica",
    )
    parser.add_argument(
        "--build-step-timeout",
        type=float,
        default=30 * 60.0,
        metavar="SECONDS",
        help="how long an image build step may run: past it its processes are killed and "
        "the step fails, saying so (default: 1800)",
    )
    parser.add_argument(
        "--log-rate",
        type=_positive_kib,
        default=DEFAULT_RATE_KIB,
        metavar="KIB",
        help="KiB a second of each replica's output shipped to its log (an endpoint's "
        "log_rate= may lower it); past it and its burst, lines are dropped and a line in "
        f"the log says how many (default: {DEFAULT_RATE_KIB})",
    )
    parser.add_argument(
        "--log-burst",
        type=_positive_kib,
        default=DEFAULT_BURST_KIB,
        metavar="KIB",
        help="KiB of output a replica may print at once beyond --log-rate "
        f"(default: {DEFAULT_BURST_KIB})",
    )
    parser.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run replicas without their mount namespace and seccomp filter (still as "
        "their workspace's user, in their PID namespace): for benchmarks and debugging "
        "only, never where tenants share the node",
    )
    parser.add_argument("--lifeline", action="store_true", help=argparse.SUPPRESS)


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1 to 65535)")
    return port


def _positive_kib(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of KiB above 0")
    return value


def _passed_name(text: str) -> str:
    try:
        return check_passed_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _passed_by_default() -> list[str]:
    return [name for name in os.environ.get(REPLICA_ENV_ENV, "").split(":") if name]


def _model_dir(text: str) -> str:
    try:
        return model_dir(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _uid_range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def worker_token(args: argparse.Namespace) -> str | None:
    """The token from --token (said to be visible in `ps`), --token-file or
    $EMBER_WORKER_TOKEN, in that order (OSError if the file cannot be read)."""
    if args.token:
        print(
            "ember worker: warning: --token shows the token to every user of this machine "
            "(ps, /proc); pass it in $EMBER_WORKER_TOKEN or --token-file instead",
            file=sys.stderr,
        )
        return str(args.token)
    if args.token_file is not None:
        return Path(args.token_file).read_text().strip() or None
    return os.environ.get(WORKER_TOKEN_ENV) or None


def _configured_ca(server_url: str) -> str | None:
    """The CA this machine's client config trusts for `server_url`, if it is that server."""
    try:
        config = load_config()
    except EmberError:
        return None
    return config.ca_cert if config.server_url.rstrip("/") == server_url.rstrip("/") else None


# Libraries whose INFO lines are one per HTTP request: noise in the worker's log, and
# a presigned blob-store URL in such a line would be a credential anyone reading could use.
CHATTY_LOGGERS = ("httpx", "httpcore", "botocore", "boto3", "s3transfer", "urllib3")


def configure_logging() -> None:
    """The agent's INFO lines on stderr, prefixed; libraries' only from WARNING up."""
    logging.basicConfig(level=logging.INFO, format="ember worker: %(message)s")
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: every `ember` command reads this module for its arguments,
    # and the agent's imports would add a tenth of a second to each.
    from ember_worker import node_probes

    node_probes.begin()  # its programs run while the agent's modules load
    from ember_worker.agent.config import AgentConfig
    from ember_worker.resources import (
        declared_gpus,
        detect_cpu,
        detect_gpus,
        detect_memory_mib,
    )

    configure_logging()
    try:
        token = worker_token(args)
    except OSError as exc:
        print(f"ember worker: cannot read --token-file: {exc}", file=sys.stderr)
        return 2
    if problem := overlap_problem(args.model_dir, args.work_dir):
        print(f"ember worker: {problem}", file=sys.stderr)
        return 2
    first, count = args.replica_uids
    taken = {
        "image build steps": (BUILD_UIDS.first, BUILD_UIDS.count),
        "replicas' and build steps' networks (pasta)": NET_UIDS.span,
    }
    if base := subordinate_ids(BASE_ACCOUNT, SUBUID):
        taken[f"debian_slim bases ({BASE_ACCOUNT} in /etc/subuid)"] = base
    for what, (other, other_count) in taken.items():
        if first < other + other_count and other < first + count:
            print(
                f"ember worker: --replica-uids {first}:{count} overlaps the uids "
                f"{what} run as ({other}:{other_count})",
                file=sys.stderr,
            )
            return 2
    try:  # EMBER_REPLICA_ENV's names too, which argparse does not check
        passed = tuple(dict.fromkeys(map(check_passed_name, args.replica_env)))
    except ValueError as exc:
        print(f"ember worker: --replica-env: {exc}", file=sys.stderr)
        return 2
    if not token:
        print(
            "ember worker: a token is needed: set EMBER_WORKER_TOKEN or pass --token-file",
            file=sys.stderr,
        )
        return 2
    # Whatever umask it inherits (`ember server` runs with 077): what a replica's user
    # must read (a pip environment, an extracted bundle) is made with the usual modes
    # and kept from other users by its folder's (replica_access.py); records, keys and
    # images get 0600/0700 where they are written.
    os.umask(0o022)
    servers = tuple(url.strip() for url in args.server.split(",") if url.strip())
    config = AgentConfig(
        server_url=servers[0],
        server_urls=servers,
        token=token,
        # Absolute: replicas run in their bundle's folder and are handed this path.
        ca_cert=str(Path(args.ca_cert).resolve()) if args.ca_cert else _configured_ca(servers[0]),
        work_dir=args.work_dir,
        name=args.name,
        cpu=args.cpu or detect_cpu(),
        memory=args.memory or detect_memory_mib(),
        gpus=declared_gpus(args.gpus) if args.gpus is not None else detect_gpus(),
        lazy_restore=args.lazy_restore,
        huge_pages=args.huge_pages,
        fetch_ahead=not args.no_fetch_ahead,
        snapshot_budget_bytes=int(args.snapshot_cache_gb * 1e9),
        weights_cache_bytes=int(args.weights_cache_gb * 1e9),
        volume_cache_bytes=int(args.volume_cache_gb * 1e9),
        bundle_cache_bytes=int(args.bundle_cache_gb * 1e9),
        image_roots_bytes=int(args.image_roots_gb * 1e9),
        channel_socket=args.channel_socket,
        replica_channel_socket=args.replica_channel_socket,
        labels=dict(args.label),
        shutdown_grace=args.shutdown_grace,
        replica_uids=args.replica_uids,
        replica_pids_max=args.replica_pids_max,
        sandbox=not args.no_sandbox,
        model_dirs=tuple(args.model_dir),
        replica_env=passed,
        build_step_timeout=args.build_step_timeout,
        log_limit=LogLimit(args.log_rate, args.log_burst),
        loopback_ports=tuple(dict.fromkeys(args.replica_loopback_port)),
    )
    return eventloop.run(_run(config, args.lifeline))


def _dump_tasks() -> None:
    """SIGUSR1: print every task's stack, to see what a stuck agent waits for."""
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


async def _run(config: AgentConfig, lifeline: bool) -> int:
    from ember_worker.agent.node_agent import Agent

    agent = Agent(config)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _dump_tasks)
    if lifeline:
        loop = asyncio.get_running_loop()

        def watch() -> None:
            while os.read(0, 4096):  # not sys.stdin: see ember_worker.replica.boot
                pass
            loop.call_soon_threadsafe(agent.stopping.set)

        threading.Thread(target=watch, name="ember-lifeline", daemon=True).start()
    await agent.run()
    return 1 if agent.refused else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember worker", description="Run an Ember worker node.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
