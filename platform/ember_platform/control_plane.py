"""The control plane put together, served and stopped (`ControlPlane`): state and blob
stores, tokens, the cluster and its queues, webhooks, the HTTPS server and the channels.

Loaded by `Server` (server.py) once its socket, TLS files and local worker are under way:
these imports are most of a control plane's start, and the local worker starts meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gc
import logging
import os
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from ember.errors import ConfigError, InvalidError
from ember.wire.limits import MAX_CHANNEL_MESSAGE_BYTES
from ember_platform.api.deploys import bundle_key
from ember_platform.api.v1 import Api
from ember_platform.batches.openai_files import OpenAIFiles
from ember_platform.batches.runner import BatchRunner
from ember_platform.calls.records import CallRecords
from ember_platform.calls.spans import SpanExporter, exporter_from, settings_problem
from ember_platform.calls.webhooks import WebhookSender, load_secret
from ember_platform.config import ServerConfig
from ember_platform.core.cluster import Cluster
from ember_platform.core.controller import Controller
from ember_platform.core.history_sampler import sample_forever, sample_seconds
from ember_platform.http.app import PlatformApp
from ember_platform.http.batch_api import BatchApi
from ember_platform.http.channels import Channels, ChannelServer, channel_server
from ember_platform.http.gateway import Gateway
from ember_platform.http.https_server import GatewayLimits, PromptShutdownServer, limited_protocol
from ember_platform.observability.history import MetricsHistory
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.peers.handover import answer_sync_calls_while_stopping
from ember_platform.security.own_certificate import CHECK_SECONDS, OwnCertificate, warnings_for
from ember_platform.security.tls import TlsFiles
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.server_info import ServerInfo, admin_token_of, public_url_of
from ember_platform.storage.blob_deletes import (
    COLLECT_EVERY_SECONDS,
    RETRY_EVERY_SECONDS,
    FailedDeletes,
)
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.s3_blobs import BlobStoreError
from ember_platform.storage.state_store import StateStore
from ember_platform.store_opening import check_blob_store_of, open_blob_store, open_state_store

if TYPE_CHECKING:
    from ember_platform.local_worker import LocalWorker
    from ember_platform.peers.leadership import Leadership

log = logging.getLogger("ember.server")


def _own_certificate(config: ServerConfig) -> OwnCertificate | None:
    """The operator's certificate (--tls-cert, --tls-key), served beside the platform's
    own to callers asking for its names; what is amiss with it is said at start."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    own = OwnCertificate(config.tls_cert, config.tls_key, config.domain)
    for warning in warnings_for(own.loaded, config.domain, dt.datetime.now(dt.UTC)):
        log.warning("%s", warning)
    return own


async def _watch_renewals(own: OwnCertificate, asked: asyncio.Event) -> None:
    """Serve a renewed certificate: at once when `asked` (SIGHUP), else once its files
    change."""
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asked.wait(), CHECK_SECONDS)
        sighup = asked.is_set()
        asked.clear()
        await asyncio.to_thread(own.reload, only_if_changed=not sighup)


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


def _resume_canaries(cluster: Cluster, store: StateStore) -> None:
    """The canaries on trial at the last stop, on trial again; one whose app was redeployed
    or stopped meanwhile, or that no longer applies, withdrawn."""
    for canary in store.canary_deployments():
        live = {r.version for r in cluster.endpoints.values() if r.app == canary.app}
        if live and canary.version > max(live):
            try:
                cluster.trials.apply(canary)
            except (InvalidError, TypeError, KeyError, ValueError) as exc:
                log.error("canary %s version %d left out: %s", canary.app, canary.version, exc)
                store.withdraw_deployment(canary.app, canary.version)
        else:  # its app was redeployed or stopped meanwhile
            store.withdraw_deployment(canary.app, canary.version)


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


# Collections of the youngest objects a call leaves (its scope, headers, tasks, futures)
# run every this many allocations instead of CPython's 700: a few tens of KiB more held
# between them, and a twentieth of the collections.
YOUNG_COLLECTION_EVERY = 20_000


def _settle_the_heap() -> None:
    """Once started: what start-up made (modules, the store's rows, the app) is frozen out
    of the cyclic collector's scans, and calls' garbage is collected in larger batches.
    Collections were 5 % of the control plane's CPU per call (bench/gateway.py)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, old)


async def _wait_for_worker(
    cluster: Cluster, stopping: Callable[[], bool], timeout: float = 30.0
) -> None:
    """Until the local worker registers; not past `timeout`, nor once the server stops (a
    Ctrl+C during the start stops the worker too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cluster.workers and not stopping() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if not cluster.workers and not stopping():
        log.error("the local worker has not registered after %.0f s", timeout)


async def _ended(task: asyncio.Task[None]) -> None:
    """`task` cancelled and waited for. What it raised stays its own: asyncio reports an
    exception nobody retrieved, and a task awaited where it runs has raised it there."""
    task.cancel()
    await asyncio.wait({task})


class ControlPlaneServer(PromptShutdownServer):
    """Says when its shutdown begins, so that answers that would wait on (log follows,
    call waits) end before uvicorn's graceful timeout would cancel them. It takes no
    signals: the process's are `Server`'s (server.py), which tells it to stop."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ControlPlane:
    """One control plane's life in three phases, as uvicorn's `Server` has (startup, main
    loop, shutdown): `build()` opens the stores and composes the parts, taking up what the
    last run left; `serve()` serves HTTPS on the socket (and the local worker's channels)
    with its background work until `stop()`, or until the platform's lease is lost (with
    `leadership`, one of several processes: then it writes nothing more to the store,
    another process owns the platform); `close()` stops in order. `blobs`: the blob store,
    opened already (a standby opens it before it takes over), else opened here. `local`,
    the local worker already started, is supervised meanwhile and stopped at the end."""

    # Made by build():
    own: OwnCertificate | None
    store: StateStore
    tokens: TokenRegistry
    admin_token: str
    logs: LogSink
    blobs: BlobStore
    webhooks: WebhookSender
    spans: SpanExporter | None
    cluster: Cluster
    channels: Channels
    api: Api
    failed_deletes: FailedDeletes
    history: MetricsHistory
    limits: GatewayLimits
    https: ControlPlaneServer

    def __init__(
        self,
        config: ServerConfig,
        sock: socket.socket,
        tls: TlsFiles,
        url: str,
        local: LocalWorker | None,
        announce: Callable[[ServerInfo], None],
        *,
        leadership: Leadership | None = None,
        blobs: BlobStore | None = None,
    ) -> None:
        self.config = config
        self.sock = sock
        self.tls = tls
        self.url = url
        self.public_url = public_url_of(config, url)
        self.local = local
        self.leadership = leadership
        self._announce = announce
        self._opened_blobs = blobs
        self._fences_at_start = leadership.fences if leadership is not None else 0
        # The tasks that run while it serves, each ended (cancelled, waited for) as it ends.
        self._background = contextlib.AsyncExitStack()
        self._renewal_asked = asyncio.Event()
        self._channel_server: ChannelServer | None = None
        self._channel_serving: asyncio.Task[None] | None = None

    async def build(self) -> None:
        """The stores opened (ConfigError if the config's cannot be used), the parts
        composed with the services each is handed, and what the last run left taken up."""
        config = self.config
        self.own = _own_certificate(config)
        otlp_problem = settings_problem(config.otlp_endpoint)
        if otlp_problem is not None:
            raise ConfigError(otlp_problem)
        self.store = open_state_store(config)
        # One database, one blob store: a server started with another is refused.
        await asyncio.to_thread(check_blob_store_of, self.store, config)
        self.tokens = TokenRegistry(self.store)
        if self.local is not None:
            self.tokens.add_ephemeral(self.local.token, Scope.WORKER)
        self.admin_token = admin_token_of(config.state_dir, self.tokens)
        self.logs = LogSink(config.log_dir)
        if self._opened_blobs is not None:
            self.blobs = self._opened_blobs
        else:
            self.blobs = await asyncio.to_thread(open_blob_store, config)
        self.cluster = self._cluster()
        files = OpenAIFiles(self.store, self.blobs)
        self.batches = BatchRunner(self.cluster, files, config.batch_max_requests)
        await self._take_up_the_last_run()
        self.channels = Channels(self.cluster, self.tokens)
        self.api = Api(
            self.cluster, self.tokens, self.blobs, self.public_url, self.batches.forget_workspace
        )
        await asyncio.to_thread(_sweep_uploads, self.api)
        # Blobs whose delete failed before the last stop: sent again now.
        unwanted = [self.api.volumes.blob_unwanted, self.cluster.snapshots.blob_unwanted]
        self.failed_deletes = FailedDeletes(self.store, self.blobs, unwanted)
        sent = self.failed_deletes.retry()
        if sent:
            log.warning("sending again %d blob delete(s) that failed before the last stop", sent)
        # The dashboard's plots: the last hour, in memory.
        self.history = MetricsHistory(interval=sample_seconds(os.environ))
        gateway = Gateway(self.cluster, self.tokens, config, BatchApi(self.batches, files))
        self.https = self._https_server(PlatformApp(self.api, self.channels, gateway, self.history))

    def _cluster(self) -> Cluster:
        """The cluster, handed metrics, call records, webhooks and spans (the last two
        kept here too, for the orderly stop)."""
        config = self.config
        metrics = PlatformMetrics()
        calls = CallRecords(self.store)
        self.webhooks = WebhookSender(
            load_secret(config.state_dir),
            self.public_url,
            self.logs,
            metrics,
            calls.webhook_ended,
            retry_delays=config.webhook_retry_delays,
            ca_cert=config.webhook_ca_cert,
        )
        self.spans = exporter_from(config.otlp_endpoint, config.otlp_headers, config.otlp_ca_cert)
        if self.spans is not None:
            self.spans.start()
        return Cluster(
            config,
            self.store,
            self.logs,
            blobs=self.blobs,
            metrics=metrics,
            calls=calls,
            webhooks=self.webhooks,
            spans=self.spans,
        )

    async def _take_up_the_last_run(self) -> None:
        """The deployments and `ember scale`'s overrides of the versions that serve, the
        canaries on trial, the async calls unfinished and the webhooks unsent."""
        cluster = self.cluster
        for refusal in cluster.deployments.resume():
            log.error("%s", refusal)
        cluster.deployments.restore_scaling()
        if self.leadership is None:  # a takeover serves first, and warns soon after
            await asyncio.to_thread(_warn_of_missing_bundles, cluster, self.blobs, self.config)
        _resume_canaries(cluster, self.store)
        recovered = cluster.input_lifecycle.recover_calls()
        if recovered:
            log.warning("requeued %d unfinished async calls", recovered)
        if cluster.journal.resume_webhooks():
            log.warning("sending the webhooks of calls that ended before the restart")
        if self.batches.take_up():
            log.warning("taking up the batches a previous control plane left unfinished")

    def _https_server(self, app: PlatformApp) -> ControlPlaneServer:
        """uvicorn's server of `app`, with the gateway's limits (kept for the local
        channels' server too) and the operator's certificate beside the platform's."""
        config = self.config
        self.limits = GatewayLimits(
            max_head_bytes=config.max_head_bytes,
            max_headers=config.max_headers,
            head_timeout=config.head_timeout_seconds,
            max_connections=config.max_connections,
            max_connections_per_address=config.max_connections_per_address,
        )
        uvicorn_config = uvicorn.Config(
            app,
            ssl_certfile=str(self.tls.server_cert),
            ssl_keyfile=str(self.tls.server_key),
            log_level=config.log_level,
            access_log=False,
            lifespan="off",
            ws_ping_interval=None,  # replicas and workers send their own heartbeats
            ws_max_size=MAX_CHANNEL_MESSAGE_BYTES,  # a result as large as replicas allow
            timeout_graceful_shutdown=5,
            timeout_keep_alive=config.keep_alive_seconds,
            http=limited_protocol(self.limits),
        )
        uvicorn_config.load()  # makes its SSL context, which the operator's certificate joins
        if self.own is not None:
            assert uvicorn_config.ssl is not None  # load() made it from ssl_certfile
            self.own.attach(uvicorn_config.ssl)
        return ControlPlaneServer(uvicorn_config, on_shutdown=self._begin_stopping)

    async def serve(self) -> None:
        """Serve until told to stop, or until the platform's lease is lost; the background
        work runs meanwhile, in one AsyncExitStack, and ends with it."""
        async with self._background:
            controller = self._in_background(Controller(self.cluster).run())
            self._in_background(sample_forever(self.cluster, self.history))
            self._in_background(self.batches.run())
            self._in_background(_send_failed_deletes_again(self.failed_deletes))
            if self.own is not None:
                self._in_background(_watch_renewals(self.own, self._renewal_asked))
            if self.leadership is not None:
                self._in_background(self._fence_when_lost(self.leadership, controller))
                missing = asyncio.to_thread(
                    _warn_of_missing_bundles, self.cluster, self.blobs, self.config
                )
                self._in_background(missing)
            serving = self._in_background(self.https.serve(sockets=[self.sock]))
            if await self._started(serving):
                if self.local is not None:
                    await self._serve_local_worker(self.local)
                own = self.own.describe() if self.own is not None else None
                info = ServerInfo.of(
                    self.url, self.tls.ca_cert, self.admin_token, self.public_url, own
                )
                self._announce(info)
                _settle_the_heap()
            await serving

    async def _started(self, serving: asyncio.Task[None]) -> bool:
        """Whether the HTTPS server started; raises what made uvicorn fail to."""
        while not self.https.started:
            if serving.done():
                await serving
                return False
            await asyncio.sleep(0.01)
        return True

    async def _serve_local_worker(self, local: LocalWorker) -> None:
        """The local worker's channels and its replicas' served on its Unix sockets, the
        worker kept running, and its registration waited for."""
        self._channel_server = channel_server(self.channels, self.https.config, self.limits)
        # One of several processes serves its local worker's sockets again after a lost
        # lease: a duplicate, which uvicorn may close when this turn ends.
        sockets = [local.listening, local.replica_listening]
        if self.leadership is not None:
            sockets = [sock.dup() for sock in sockets]
        self._channel_serving = asyncio.ensure_future(self._channel_server.serve(sockets=sockets))
        self._in_background(local.supervise(lambda: self.stopping))
        await _wait_for_worker(self.cluster, lambda: self.stopping)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """`work` as a task that ends (cancelled, waited for) when serving ends, the last
        begun first."""
        task = asyncio.ensure_future(work)
        self._background.push_async_callback(_ended, task)
        return task

    def _begin_stopping(self) -> None:
        self.api.begin_stopping()
        if self.leadership is not None:  # another process takes over: its calls answered
            self._in_background(answer_sync_calls_while_stopping(self.cluster))

    async def _fence_when_lost(
        self, leadership: Leadership, controller: asyncio.Task[None]
    ) -> None:
        """The platform's lease lost: stop scheduling at once, and the HTTPS server without
        waiting on its requests. Every connection is cut, as a killed process's would be:
        callers get a retryable cut rather than wait on calls nothing will end, and workers
        and replicas go to the next owner."""
        await leadership.lost.wait()
        controller.cancel()
        self.https.should_exit = True
        self.https.force_exit = True
        for connection in list(self.https.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()

    @property
    def stopping(self) -> bool:
        return self.https.should_exit

    def stop(self, *, at_once: bool = False) -> None:
        """Stop serving, in order; `at_once` (a second Ctrl+C), without waiting on the
        requests in flight, as uvicorn's `force_exit`."""
        self.https.should_exit = True
        if at_once:
            self.https.force_exit = True

    def renew_certificate(self) -> None:
        """Serve the operator's renewed certificate at once (SIGHUP), if it has one."""
        self._renewal_asked.set()

    async def close(self) -> None:
        """The orderly stop, once serving has ended: the local channels closed first, as
        the HTTPS server's are (replicas that lose their channel exit at once, before the
        worker is stopped); webhooks, spans and logs sent; the blob store's deletes landed
        (those that failed are sent again at the next start); the usage of the replicas
        that end with this process and the call records the store would not take written;
        the store closed. A fenced process writes nothing more, and keeps its local
        worker for when it owns the platform again."""
        fenced = self.leadership is not None and self.leadership.fences > self._fences_at_start
        if self._channel_server is not None and self._channel_serving is not None:
            self._channel_server.should_exit = True
            with contextlib.suppress(Exception):
                await self._channel_serving
        if self.local is not None and not fenced:
            self.local.stop()
        await self.webhooks.close()
        if self.spans is not None:
            await self.spans.close()
        self.logs.flush()
        await asyncio.to_thread(self.blobs.close)
        self.failed_deletes.collect()
        if not fenced:
            self.cluster.replica_lifecycle.record_live_usage()
            if self.cluster.calls.retry():
                log.warning(
                    "stopping with %d async call records the state store would not take: "
                    "those calls' latest states are lost",
                    self.cluster.calls.held,
                )
        self.store.close()
