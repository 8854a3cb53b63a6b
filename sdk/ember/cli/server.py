"""`ember server`: the control plane and a local worker, on embedded defaults."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ember.calling import eventloop
from ember.cli.common import node_label, port_number, positive_number
from ember.errors import ConfigError, InvalidError
from ember.wire.labels import checked_domain


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "server",
        help="run the platform on this machine",
        description="Run the control plane (HTTPS gateway, queues, autoscaler, SQLite state, "
        "local blob folder) and a local worker. The first start creates a CA, a server "
        "certificate and an admin token in the state directory and writes the client "
        "configuration, so that `ember deploy` and the other commands need no flags.",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path.home() / ".ember" / "server",
        help="where state, blobs, logs and certificates live (default: ~/.ember/server)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=port_number, default=8443, help="HTTPS port (default: 8443; 0 picks one)"
    )
    parser.add_argument(
        "--domain",
        type=_domain,
        help="wildcard domain: serve endpoints at https://LABEL.DOMAIN/ too (a host name, "
        "without a port)",
    )
    parser.add_argument("--no-worker", action="store_true", help="do not start a local worker")
    parser.add_argument(
        "--deploy",
        type=Path,
        action="append",
        default=[],
        metavar="FILE.py",
        help="deploy this app once the platform is up (repeatable)",
    )
    parser.add_argument(
        "--lazy-restore",
        action="store_true",
        help="make the local worker restore snapshots lazily: a replica runs before its "
        "memory is all back, pages arriving on first touch (see `ember worker --help`)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="make the local worker restore replicas' dense memory into 2 MiB pages "
        "(see `ember worker --help`)",
    )
    parser.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run the local worker's replicas without their mount namespace and seccomp "
        "filter: for benchmarks and debugging only (see `ember worker --help`)",
    )
    parser.add_argument(
        "--model-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of this machine the local worker's replicas may read, such as "
        "weights by file:// URL (repeatable; see `ember worker --help`)",
    )
    parser.add_argument(
        "--replica-env",
        action="append",
        default=[],
        metavar="NAME",
        help="a variable of this server's environment to hand on to the local worker's "
        "replicas (repeatable; see `ember worker --help`): nothing else of it reaches them",
    )
    parser.add_argument(
        "--replica-loopback-port",
        action="append",
        type=int,
        default=[],
        metavar="PORT",
        help="a port of this node's loopback the local worker's sandboxed replicas may "
        "reach (repeatable; see `ember worker --help`)",
    )
    parser.add_argument(
        "--replica-pids-max",
        type=int,
        default=None,
        metavar="N",
        help="processes and threads each of the local worker's replicas may hold at once "
        "(see `ember worker --help`; default: 4096)",
    )
    parser.add_argument(
        "--build-step-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long an image build step on the local worker may run (see `ember worker "
        "--help`; default: 1800)",
    )
    parser.add_argument(
        "--log-rate",
        type=int,
        default=None,
        metavar="KIB",
        help="KiB a second of each replica's output on the local worker shipped to its log "
        "(see `ember worker --help`; default: 1024)",
    )
    parser.add_argument(
        "--log-burst",
        type=int,
        default=None,
        metavar="KIB",
        help="KiB a replica on the local worker may print at once beyond --log-rate "
        "(default: 10240)",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        help="GPUs the local worker offers, e.g. H100:8 or none (default: the NVIDIA GPUs "
        "nvidia-smi lists)",
    )
    for cache, default, what in (
        ("snapshot", 20, "snapshot images"),
        ("weights", 50, "the weights its replicas read"),
        ("volume", 50, "copies of ember.Volume folders"),
        ("bundle", 2, "extracted app bundles"),
    ):
        parser.add_argument(
            f"--{cache}-cache-gb",
            type=positive_number,
            default=float(default),
            metavar="GB",
            help=f"the local worker's disk for {what} (default: {default})",
        )
    parser.add_argument(
        "--worker-label",
        action="append",
        type=node_label,
        default=[],
        metavar="KEY=VALUE",
        help="a label of the local worker node (repeatable), for endpoints' node_labels=",
    )
    parser.add_argument("--max-body-mb", type=float, default=8.0, help="request body limit in MiB")
    parser.add_argument(
        "--price",
        metavar="PRICES",
        help="what replicas' resources cost, for `ember usage` and /metrics: such as "
        "cpu=0.04/h,memory-gib=0.005/h,gpu:H100=2.5/h (per hour unless /min or /s)",
    )
    parser.add_argument(
        "--batch-file-mb",
        type=float,
        default=64.0,
        help="the OpenAI Batch API's input files: their limit in MiB (64)",
    )
    parser.add_argument(
        "--batch-max-requests",
        type=int,
        default=50_000,
        help="requests in one batch at most (50,000, as OpenAI's): a larger file is a 400",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=1000,
        help="queued inputs per endpoint before callers get 429 (default: 1000)",
    )
    parser.add_argument(
        "--workspace-max-queued",
        type=_count,
        default=10_000,
        metavar="N",
        help="inputs a workspace may have queued over all its endpoints before its callers "
        "get 429, unless `ember workspace set --max-queued` sets its own (default: 10000)",
    )
    parser.add_argument(
        "--workspace-max-running",
        type=_count,
        default=1_000,
        metavar="N",
        help="calls a workspace may have running on replicas at once before its callers "
        "get 429, unless `ember workspace set --max-running` sets its own (default: 1000)",
    )
    parser.add_argument(
        "--workspace-rate",
        metavar="N/PERIOD",
        help="calls a workspace may start, such as 500/s or 30000/min: bursts up to N, then "
        "that rate; past it its callers get 429 with Retry-After, unless `ember workspace "
        "set --rate` sets its own (default: no limit)",
    )
    parser.add_argument(
        "--workspace-held-mb",
        type=_count,
        default=256,
        metavar="MIB",
        help="MiB of calls' bodies, and of their results and stream events, one workspace "
        "may have held in the control plane at once (each): past it its new calls wait for "
        "room (503 after 10 s) and its replicas' answers wait in them (default: 256)",
    )
    parser.add_argument(
        "--max-held-mb",
        type=_count,
        default=1024,
        metavar="MIB",
        help="MiB of bodies, and of results and stream events, all workspaces may have held "
        "at once (each): past it, a workspace past an even share of it waits (default: 1024)",
    )
    parser.add_argument(
        "--max-header-kb",
        type=_count,
        default=64,
        metavar="KIB",
        help="the most a request line and its headers may take, in all, before the caller "
        "gets 431 and the connection closes (default: 64)",
    )
    parser.add_argument(
        "--max-headers",
        type=_count,
        default=100,
        help="the most headers a request may have before the caller gets 431 (default: 100)",
    )
    parser.add_argument(
        "--head-timeout",
        type=positive_number,
        default=10.0,
        metavar="SECONDS",
        help="how long a connection may take to send a request's line and headers before "
        "it is closed; streams, long calls and WebSockets, once started, are not cut "
        "(default: 10)",
    )
    parser.add_argument(
        "--keep-alive",
        type=_count,
        default=5,
        metavar="SECONDS",
        help="how long a connection may stay idle between requests (default: 5; Ember's "
        "clients close theirs after 4, so a lower value may cut a call now and then)",
    )
    parser.add_argument(
        "--max-connections",
        type=_count,
        default=10_000,
        help="connections open at once before new ones get 503 (default: 10000)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=_count,
        default=1_000,
        metavar="N",
        help="connections open at once from one client address before its new ones get "
        "503 (default: 1000)",
    )
    parser.add_argument(
        "--stop-grace",
        type=positive_number,
        default=30.0,
        metavar="SECONDS",
        help="how long a replica asked to stop (scaled down, replaced, `ember replica stop`) "
        "may take to finish its inputs and @ember.exit hooks before it is killed (default: 30)",
    )
    parser.add_argument(
        "--webhook-ca-cert",
        type=Path,
        metavar="PEM",
        help="a CA to trust beside the system's for webhook receivers (a private network's)",
    )
    parser.add_argument(
        "--allow-http-webhooks",
        action="store_true",
        help="let webhooks go to http:// URLs too (development only: the signed body and "
        "the result in it travel in the clear)",
    )
    parser.add_argument(
        "--webhook-retry-delays",
        type=_delays,
        default=(5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0),
        metavar="S,S,...",
        help="seconds before each retry of a webhook that failed (default: 5,30,120,600,1800,3600)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send each request's span to this OpenTelemetry collector over OTLP/HTTP "
        "(e.g. http://127.0.0.1:4318; default: $OTEL_EXPORTER_OTLP_ENDPOINT, else none)",
    )
    parser.add_argument(
        "--otlp-header",
        type=_header,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a header for the collector, e.g. its API key (repeatable; "
        "$OTEL_EXPORTER_OTLP_HEADERS is read too)",
    )
    parser.add_argument(
        "--otlp-ca-cert", type=Path, metavar="PEM", help="a CA to trust for the collector"
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PEM",
        help="your certificate chain (e.g. Let's Encrypt's fullchain.pem for --domain's "
        "names), served to callers who ask for a name it covers; others get the "
        "platform's own. A renewal is picked up within a minute, or at once on SIGHUP",
    )
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--public-url",
        type=_public_url,
        metavar="URL",
        help="where callers reach this server, when not at https://HOST:PORT (a load "
        "balancer, a port mapping), e.g. https://ember.example.com: the endpoints' URLs "
        "it prints and the status_url of webhook payloads",
    )
    parser.add_argument(
        "--blob-store",
        type=_s3_url,
        metavar="s3://BUCKET[/PREFIX]",
        help="keep bundles, snapshot images and volume files in an S3 bucket instead of "
        "the state dir (credentials and region: the AWS settings of this environment); "
        "the bucket must exist",
    )
    parser.add_argument(
        "--blob-s3-endpoint-url",
        metavar="URL",
        help="the S3 API of --blob-store when not AWS's (MinIO, Ceph, R2), e.g. "
        "http://127.0.0.1:9000",
    )
    parser.add_argument(
        "--move-blob-store",
        action="store_true",
        help="record --blob-store as the database's blob store in place of the one it was "
        "used with (its blobs copied there, or the apps to be deployed again); without it, "
        "a server on a PostgreSQL database used with another store is refused",
    )
    parser.add_argument(
        "--database",
        type=_database_url,
        default=os.environ.get("EMBER_DATABASE_URL") or None,
        metavar="postgresql://USER@HOST:PORT/DB",
        help="keep the platform's state in this PostgreSQL database instead of SQLite in "
        "the state dir (default: $EMBER_DATABASE_URL); its tables are made, or brought up "
        "to date, at start. Several servers on one database serve one platform: the one "
        "holding its lease owns it, the others pass their connections on to it",
    )
    parser.add_argument(
        "--advertise-url",
        type=_public_url,
        default=os.environ.get("EMBER_ADVERTISE_URL") or None,
        metavar="https://HOST:PORT",
        help="with --database: where the other servers reach this one when it owns the "
        "platform (default: $EMBER_ADVERTISE_URL, else https://HOST:PORT of --host and --port)",
    )
    parser.set_defaults(run=run)


def _header(text: str) -> tuple[str, str]:
    """An argparse type: KEY=VALUE."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), value.strip()


def _domain(text: str) -> str:
    """An argparse type: a host name, as the certificate, routing and URLs spell it."""
    try:
        return checked_domain(text)
    except InvalidError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _public_url(text: str) -> str:
    """An argparse type: an https URL of a host (a port too), without a path or a query."""
    parts = urlsplit(text)
    if parts.scheme != "https" or not parts.hostname or parts.path.strip("/") or parts.query:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an https URL of a host, e.g. https://ember.example.com"
        )
    return text.rstrip("/")


def _s3_url(text: str) -> str:
    """An argparse type: s3://BUCKET or s3://BUCKET/PREFIX."""
    bucket = text.removeprefix("s3://").partition("/")[0]
    if not text.startswith("s3://") or not bucket:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an S3 URL; write s3://BUCKET or s3://BUCKET/PREFIX"
        )
    return text


def _database_url(text: str) -> str:
    """An argparse type: a PostgreSQL URL."""
    if urlsplit(text).scheme not in ("postgresql", "postgres"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a PostgreSQL URL; write postgresql://USER@HOST:PORT/DATABASE"
        )
    return text


def _delays(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated seconds, each a positive number."""
    return tuple(positive_number(part.strip()) for part in text.split(",") if part.strip())


def _curl_line(info: Any, endpoint: dict[str, Any]) -> str:
    url = endpoint["urls"][-1]
    if endpoint["methods"] and endpoint["methods"] != ["__call__"]:
        url += endpoint["methods"][0]
    parts = ["curl", "--cacert", str(info.ca_cert)]
    if not endpoint["public"]:
        parts += ["-H", f"Authorization: Bearer {info.admin_token}"]
    parts += ["-d", "{}", url]
    return " ".join(shlex.quote(p) for p in parts)


async def _serve(args: argparse.Namespace) -> int:
    from ember.cli.apps.deploy import deploy, describe
    from ember_platform.config import ServerConfig
    from ember_platform.server import Server

    config = ServerConfig(
        state_dir=args.state_dir.expanduser(),
        host=args.host,
        port=args.port,
        domain=args.domain,
        local_worker=not args.no_worker,
        lazy_restore=args.lazy_restore,
        local_worker_gpus=args.gpus,
        local_worker_options=(
            f"--snapshot-cache-gb={args.snapshot_cache_gb:g}",
            f"--weights-cache-gb={args.weights_cache_gb:g}",
            f"--volume-cache-gb={args.volume_cache_gb:g}",
            f"--bundle-cache-gb={args.bundle_cache_gb:g}",
            *(f"--label={key}={value}" for key, value in args.worker_label),
            *(["--huge-pages"] if args.huge_pages else []),
            *(["--no-sandbox"] if args.no_sandbox else []),
            *(f"--model-dir={folder}" for folder in args.model_dir),
            *(f"--replica-env={name}" for name in args.replica_env),
            *(f"--replica-loopback-port={port}" for port in args.replica_loopback_port),
            *(
                [f"--build-step-timeout={args.build_step_timeout:g}"]
                if args.build_step_timeout is not None
                else []
            ),
            *([f"--log-rate={args.log_rate}"] if args.log_rate is not None else []),
            *(
                [f"--replica-pids-max={args.replica_pids_max}"]
                if args.replica_pids_max is not None
                else []
            ),
            *([f"--log-burst={args.log_burst}"] if args.log_burst is not None else []),
        ),
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        price=args.price,
        batch_file_bytes=int(args.batch_file_mb * 1024 * 1024),
        batch_max_requests=args.batch_max_requests,
        max_queue=args.max_queue,
        workspace_max_queued=args.workspace_max_queued,
        workspace_max_running=args.workspace_max_running,
        workspace_rate=args.workspace_rate,
        workspace_held_mb=args.workspace_held_mb,
        max_held_mb=args.max_held_mb,
        max_head_bytes=args.max_header_kb * 1024,
        max_headers=args.max_headers,
        head_timeout_seconds=args.head_timeout,
        keep_alive_seconds=args.keep_alive,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        stop_grace_seconds=args.stop_grace,
        webhook_allow_http=args.allow_http_webhooks,
        webhook_ca_cert=args.webhook_ca_cert,
        webhook_retry_delays=args.webhook_retry_delays,
        otlp_endpoint=args.otlp_endpoint,
        otlp_headers=dict(args.otlp_header),
        otlp_ca_cert=args.otlp_ca_cert,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        public_url=args.public_url,
        blob_store=args.blob_store,
        blob_s3_endpoint_url=args.blob_s3_endpoint_url,
        move_blob_store=args.move_blob_store,
        database=args.database,
        advertise_url=args.advertise_url,
    )
    server = Server(config)
    serving = asyncio.ensure_future(server.serve())
    ready = asyncio.ensure_future(server.ready.wait())
    await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        ready.cancel()
        await serving
        return 1
    info = server.info
    if info is None:
        raise ConfigError("the server did not start")
    _say(f"Ember is serving at {info.url}")
    _say(f"  state:  {config.state_dir}\n  CA:     {info.ca_cert}")
    if info.public_url:
        _say(f"  public URL: {info.public_url} (the endpoints' URLs it prints)")
    if info.own_certificate:
        _say(f"  your certificate: {info.own_certificate}, for callers who ask for those names")
    _say(f"  dashboard: {info.url}/dashboard (`ember dashboard` opens it signed in)")
    # Behind the operator's certificate, a node trusts the public URL with no CA file.
    join = (
        f"--server {info.public_url}"
        if info.public_url and info.own_certificate
        else f"--server {info.url} --ca-cert ca.pem"
    )
    # The token in the environment: on a command line, `ps` would show it to every user.
    token = "EMBER_WORKER_TOKEN=$(ember token create --scope worker)"
    _say(f"  join another node: {token} ember worker {join}")
    for file in args.deploy:
        result = await asyncio.to_thread(deploy, file)
        _say(describe(result))
        for endpoint in result["endpoints"]:
            _say(f"  try: {_curl_line(info, endpoint)}")
    _say("Press Ctrl+C to stop.")
    await serving
    stopped_by = server.stop_signal  # stopped in order: 130 for a Ctrl+C, 143 a SIGTERM
    return 128 + stopped_by if stopped_by else 0


def _say(text: str) -> None:
    # One write per message: the local worker shares this output, and print's separate
    # write of the newline would let its lines land inside ours.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    try:
        import ember_platform  # noqa: F401
    except ImportError:
        print(
            "ember server needs the platform: pip install 'ember[platform,worker]'", file=sys.stderr
        )
        return 2
    if args.gpus is not None:
        from ember_worker.resources import declared_gpus

        declared_gpus(args.gpus)  # a bad --gpus is said here, not by a worker in a restart loop
    if args.model_dir:  # likewise
        from ember_worker.model_dirs import model_dir, overlap_problem

        try:
            args.model_dir = [model_dir(folder) for folder in args.model_dir]
        except ValueError as exc:
            print(f"ember server: --model-dir {exc}", file=sys.stderr)
            return 2
        if problem := overlap_problem(args.model_dir, args.state_dir):
            print(f"ember server: {problem}", file=sys.stderr)
            return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("ember server: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    # What the control plane writes (blobs, logs, records) is its user's alone; files
    # meant for others (the CA certificate) are given their mode where written.
    os.umask(0o077)
    return eventloop.run(_serve(args))


def _count(text: str) -> int:
    """An argparse type: a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above zero")
    return value
