"""The control plane put together and served: state and blob stores, tokens, the cluster
and its queues, webhooks, the HTTPS server and the channels, until it is told to stop.

Loaded by `Server.serve` once its socket, TLS files and local worker are under way:
these imports are most of a control plane's start, and the local worker starts meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from ember.config import ClientConfig, save_config
from ember.errors import ConfigError, InvalidError
from ember.wire.limits import MAX_CHANNEL_MESSAGE_BYTES
from ember_platform.api.deploys import bundle_key
from ember_platform.api.v1 import Api
from ember_platform.calls.records import CallRecords
from ember_platform.calls.webhooks import WebhookSender, load_secret
from ember_platform.config import ServerConfig
from ember_platform.core.cluster import Cluster
from ember_platform.http.app import PlatformApp
from ember_platform.http.channels import Channels, channel_server
from ember_platform.http.gateway import Gateway
from ember_platform.http.https_server import GatewayLimits, PromptShutdownServer, limited_protocol
from ember_platform.observability.history import MetricsHistory
from ember_platform.observability.history_sampler import sample_forever, sample_seconds
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.spans import exporter_from, settings_problem
from ember_platform.peers.handover import answer_sync_calls_while_stopping
from ember_platform.scaling.controller import Controller
from ember_platform.security.own_certificate import CHECK_SECONDS, OwnCertificate, warnings_for
from ember_platform.security.tls import TlsFiles
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.server import STOP_SIGNALS
from ember_platform.server_info import ServerInfo, admin_token_of, public_url_of
from ember_platform.storage.blob_deletes import (
    COLLECT_EVERY_SECONDS,
    RETRY_EVERY_SECONDS,
    FailedDeletes,
)
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.opening import check_blob_store_of, open_blob_store, open_state_store
from ember_platform.storage.s3_blobs import BlobStoreError

if TYPE_CHECKING:
    from ember_platform.local_worker import LocalWorker
    from ember_platform.peers.leadership import Leadership
    from ember_platform.server import Server

log = logging.getLogger("ember.server")


async def _watch_renewals(own: OwnCertificate) -> None:
    """Serve a renewed certificate: at once on SIGHUP, else once its files change."""
    loop = asyncio.get_running_loop()
    asked = asyncio.Event()
    # Not in the main thread (an embedded server), there is no SIGHUP; files still count.
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, asked.set)
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asked.wait(), CHECK_SECONDS)
            sighup = asked.is_set()
            asked.clear()
            await asyncio.to_thread(own.reload, only_if_changed=not sighup)
    finally:
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(signal.SIGHUP)


async def _send_failed_deletes_again(deletes: FailedDeletes) -> None:
    """Note failed blob deletes as they come in, and send them again now and then."""
    since_retry = 0.0
    while True:
        await asyncio.sleep(COLLECT_EVERY_SECONDS)
        deletes.collect()
        since_retry += COLLECT_EVERY_SECONDS
        if since_retry >= RETRY_EVERY_SECONDS and deletes.pending:
            deletes.retry()
            since_retry = 0.0


def _warn_of_missing_bundles(cluster: Cluster, blobs: BlobStore, config: ServerConfig) -> None:
    """Say at start which deployed apps' bundles the blob store lacks (emptied, or
    another bucket than they were deployed to): their replicas could not start."""
    missing: dict[str, set[str]] = {}
    try:
        for runtime in list(cluster.endpoints.values()):
            digest = runtime.bundle_digest
            if digest not in missing and not blobs.exists(bundle_key(digest)):
                missing[digest] = set()
            if digest in missing:
                missing[digest].add(runtime.app)
    except (BlobStoreError, OSError) as exc:
        log.warning("could not check that the deployed apps' bundles are there: %s", exc)
        return
    store = config.blob_store or str(config.blob_dir)
    for digest, apps in missing.items():
        log.warning(
            "the blob store %s lacks the bundle %s of app %s: its replicas cannot start; "
            "deploy it again, or point --blob-store at the store it was deployed to",
            store,
            digest[:19],
            ", ".join(sorted(apps)),
        )


def _sweep_uploads(api: Api) -> None:
    """Volume uploads that interrupted writes left in the blob store, removed at start; a
    store that fails here is told later, by the requests that need it."""
    try:
        swept = api.volumes.sweep_uploads()
    except (BlobStoreError, OSError) as exc:
        log.warning("could not look for volume uploads left by interrupted writes: %s", exc)
        return
    if swept:
        log.warning("removed %d volume uploads left by interrupted writes", swept)


class ControlPlaneServer(PromptShutdownServer):
    """Says when its shutdown begins, so that answers that would wait on (log follows,
    call waits) end before uvicorn's graceful timeout would cancel them."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self.signals: list[int] = []

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, less its raising the signal again once serving ends: a SIGTERM
        raised then killed the process before the orderly stop that follows in
        `Server.serve` (deletes landing, usage and call records written). The signals
        taken are in `signals`, for the command's exit status."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals are the main thread's: an embedded server is told to stop
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        super().handle_exit(sig, frame)


async def _fence(
    leadership: Leadership, https: ControlPlaneServer, controller: asyncio.Future[None]
) -> None:
    """The platform's lease lost: stop scheduling at once, and the HTTPS server without
    waiting on its requests. Every connection is cut, as a killed process's would be:
    callers get a retryable cut rather than wait on calls nothing will end, and workers
    and replicas go to the next owner."""
    await leadership.lost.wait()
    controller.cancel()
    https.should_exit = True
    https.force_exit = True
    for connection in list(https.server_state.connections):
        transport = getattr(connection, "transport", None)
        if transport is not None:
            transport.close()


async def serve_control_plane(
    server: Server,
    sock: socket.socket,
    tls: TlsFiles,
    url: str,
    local: LocalWorker | None,
    leadership: Leadership | None = None,
    blobs: BlobStore | None = None,
) -> None:
    """Serve on `sock` until `server` is told to stop; `local`, the local worker already
    started, is supervised meanwhile and stopped at the end. With `leadership` (one of
    several processes), it also ends when the platform's lease is lost, and then writes
    nothing more to the store: another process owns the platform. `blobs`: the blob store,
    opened already (a standby opens it before it takes over), else opened here."""
    fences_at_start = leadership.fences if leadership is not None else 0
    config = server.config
    own = None
    if config.tls_cert is not None and config.tls_key is not None:
        own = OwnCertificate(config.tls_cert, config.tls_key, config.domain)
        for warning in warnings_for(own.loaded, config.domain, dt.datetime.now(dt.UTC)):
            log.warning("%s", warning)
    otlp_problem = settings_problem(config.otlp_endpoint)
    if otlp_problem is not None:
        raise ConfigError(otlp_problem)
    public_url = public_url_of(config, url)
    store = open_state_store(config)
    # One database, one blob store: a server started with another is refused.
    await asyncio.to_thread(check_blob_store_of, store, config)
    tokens = TokenRegistry(store)
    if local is not None:
        tokens.add_ephemeral(local.token, Scope.WORKER)
    admin_token = admin_token_of(config.state_dir, tokens)
    logs = LogSink(config.log_dir)
    if blobs is None:
        blobs = await asyncio.to_thread(open_blob_store, config)
    metrics = PlatformMetrics()
    calls = CallRecords(store)
    webhooks = WebhookSender(
        load_secret(config.state_dir),
        public_url,
        logs,
        metrics,
        calls.webhook_ended,
        retry_delays=config.webhook_retry_delays,
        ca_cert=config.webhook_ca_cert,
    )
    spans = exporter_from(config.otlp_endpoint, config.otlp_headers, config.otlp_ca_cert)
    if spans is not None:
        spans.start()
    cluster = Cluster(
        config,
        store,
        logs,
        blobs=blobs,
        metrics=metrics,
        calls=calls,
        webhooks=webhooks,
        spans=spans,
    )
    for refusal in cluster.resume_deployments():
        log.error("%s", refusal)
    cluster.restore_scaling()  # `ember scale`'s overrides of the versions that serve
    checking = asyncio.to_thread(_warn_of_missing_bundles, cluster, blobs, config)
    missing_bundles: asyncio.Future[None] | None = None
    if leadership is not None:  # a takeover: serving first, the warnings soon after
        missing_bundles = asyncio.ensure_future(checking)
    else:
        await checking
    for canary in store.canary_deployments():
        live = {r.version for r in cluster.endpoints.values() if r.app == canary.app}
        if live and canary.version > max(live):
            try:
                cluster.apply_canary(canary)
            except (InvalidError, TypeError, KeyError, ValueError) as exc:
                log.error("canary %s version %d left out: %s", canary.app, canary.version, exc)
                store.withdraw_deployment(canary.app, canary.version)
        else:  # its app was redeployed or stopped meanwhile
            store.withdraw_deployment(canary.app, canary.version)
    recovered = cluster.recover_calls()
    if recovered:
        log.warning("requeued %d unfinished async calls", recovered)
    if cluster.resume_webhooks():
        log.warning("sending the webhooks of calls that ended before the restart")
    channels = Channels(cluster, tokens)
    api = Api(cluster, tokens, blobs, public_url)
    await asyncio.to_thread(_sweep_uploads, api)
    # Blobs whose delete failed before the last stop: sent again now.
    failed_deletes = FailedDeletes(
        store, blobs, [api.volumes.blob_unwanted, cluster.snapshots.blob_unwanted]
    )
    sent = failed_deletes.retry()
    if sent:
        log.warning("sending again %d blob delete(s) that failed before the last stop", sent)
    # The dashboard's plots: the last hour, in memory.
    history = MetricsHistory(interval=sample_seconds(os.environ))
    app = PlatformApp(api, channels, Gateway(cluster, tokens, config), history)
    limits = GatewayLimits(
        max_head_bytes=config.max_head_bytes,
        max_headers=config.max_headers,
        head_timeout=config.head_timeout_seconds,
        max_connections=config.max_connections,
        max_connections_per_address=config.max_connections_per_address,
    )
    uvicorn_config = uvicorn.Config(
        app,
        ssl_certfile=str(tls.server_cert),
        ssl_keyfile=str(tls.server_key),
        log_level=config.log_level,
        access_log=False,
        lifespan="off",
        ws_ping_interval=None,  # replicas and workers send their own heartbeats
        ws_max_size=MAX_CHANNEL_MESSAGE_BYTES,  # a result as large as replicas allow
        timeout_graceful_shutdown=5,
        timeout_keep_alive=config.keep_alive_seconds,
        http=limited_protocol(limits),
    )
    uvicorn_config.load()  # makes its SSL context, which the operator's certificate joins
    renewals: asyncio.Future[None] | None = None
    if own is not None:
        assert uvicorn_config.ssl is not None  # load() made it from ssl_certfile
        own.attach(uvicorn_config.ssl)
        renewals = asyncio.ensure_future(_watch_renewals(own))
    handing_over: list[asyncio.Future[None]] = []

    def begin_stopping() -> None:
        api.begin_stopping()
        if leadership is not None:  # another process takes over: its calls answered
            handing_over.append(asyncio.ensure_future(answer_sync_calls_while_stopping(cluster)))

    https = server.https = ControlPlaneServer(uvicorn_config, on_shutdown=begin_stopping)
    https.should_exit = server.stop_asked  # told to stop while this process took over
    controller = asyncio.ensure_future(Controller(cluster).run())
    sampling = asyncio.ensure_future(sample_forever(cluster, history))
    deletes = asyncio.ensure_future(_send_failed_deletes_again(failed_deletes))
    fencing = (
        asyncio.ensure_future(_fence(leadership, https, controller))
        if leadership is not None
        else None
    )
    supervisor: asyncio.Future[None] | None = None
    serving = asyncio.ensure_future(https.serve(sockets=[sock]))
    channel_serving: asyncio.Future[None] | None = None
    try:
        while not https.started:
            if serving.done():
                await serving  # raises what made uvicorn fail to start
                return
            await asyncio.sleep(0.01)
        save_config(ClientConfig(url, admin_token, str(tls.ca_cert), config.domain))
        own_described = own.describe() if own is not None else None
        server.info = ServerInfo.of(url, tls.ca_cert, admin_token, public_url, own_described)
        if local is not None:
            local_channels = server.channel_server = channel_server(channels, https.config, limits)
            # One of several processes serves its local worker's socket again after a
            # lost lease: a duplicate, which uvicorn may close when this turn ends.
            sockets = [local.listening, local.replica_listening]
            if leadership is not None:
                sockets = [sock.dup() for sock in sockets]
            channel_serving = asyncio.ensure_future(local_channels.serve(sockets=sockets))
            supervisor = asyncio.ensure_future(local.supervise(lambda: server.stopping))
            await _wait_for_worker(cluster)
        server.ready.set()
        await serving
    finally:
        controller.cancel()
        if fencing is not None:
            fencing.cancel()
        for task in handing_over:
            task.cancel()
        if missing_bundles is not None:
            missing_bundles.cancel()
        fenced = leadership is not None and leadership.fences > fences_at_start
        sampling.cancel()
        deletes.cancel()
        if renewals is not None:
            renewals.cancel()
        if supervisor is not None:
            supervisor.cancel()
        if channel_serving is not None and server.channel_server is not None:
            # Closed first, as the HTTPS server's channels are: replicas that lose
            # their channel exit at once, before the worker is stopped.
            server.channel_server.should_exit = True
            with contextlib.suppress(Exception):
                await channel_serving
        if local is not None and not fenced:
            local.stop()  # a fenced process keeps it, for when it owns the platform again
        await webhooks.close()
        if spans is not None:
            await spans.close()
        logs.flush()
        await asyncio.to_thread(blobs.close)  # the deletes asked for are done
        failed_deletes.collect()  # those that failed are sent again at the next start
        if not fenced:
            cluster.record_live_usage()  # the replicas end with this process
        if not fenced and cluster.calls.retry():
            log.warning(
                "stopping with %d async call records the state store would not take: "
                "those calls' latest states are lost",
                cluster.calls.held,
            )
        store.close()


async def _wait_for_worker(cluster: Cluster, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cluster.workers and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if not cluster.workers:
        log.error("the local worker has not registered after %.0f s", timeout)
