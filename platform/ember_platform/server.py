"""The control plane's lifecycle: state, TLS, tokens, the HTTPS server, the local worker."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from ember.calling import unix_channel
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
from ember_platform.http.channels import Channels, ChannelServer, channel_server
from ember_platform.http.gateway import Gateway
from ember_platform.http.https_server import GatewayLimits, PromptShutdownServer, limited_protocol
from ember_platform.observability.history import MetricsHistory
from ember_platform.observability.history_sampler import sample_forever, sample_seconds
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.spans import exporter_from, settings_problem
from ember_platform.scaling.controller import Controller
from ember_platform.security.own_certificate import CHECK_SECONDS, OwnCertificate, warnings_for
from ember_platform.security.state_files import kept_secret, replace_secret
from ember_platform.security.tls import TlsFiles, ensure_tls
from ember_platform.security.tokens import Scope, TokenRegistry
from ember_platform.storage.blob_deletes import (
    COLLECT_EVERY_SECONDS,
    RETRY_EVERY_SECONDS,
    FailedDeletes,
)
from ember_platform.storage.blob_store_identity import blob_store_identity, check_blob_store
from ember_platform.storage.blobs import BlobStore, LocalBlobStore
from ember_platform.storage.s3_blobs import BlobStoreError
from ember_platform.storage.sqlite_store import SqliteStateStore
from ember_platform.storage.state_lock import StateDirLock
from ember_platform.storage.state_store import StateStore

log = logging.getLogger("ember.server")

ADMIN_TOKEN_FILE = "admin-token"
MAX_PORT = 65535
# How long a local worker that exited waits before it is restarted, for a signal that
# stops this server too to arrive.
WORKER_EXIT_GRACE_SECONDS = 0.2
# Those that stop the server in order (Ctrl+C, a service manager's stop).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class ServerInfo:
    url: str
    ca_cert: Path
    admin_token: str
    own_certificate: str | None = None  # what --tls-cert serves, to callers asking for it
    public_url: str | None = None  # --public-url, where it differs from `url`


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for
    # sockets created with it; without, Nagle adds ~40 ms to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def admin_token_of(state_dir: Path, tokens: TokenRegistry) -> str:
    """The admin token is created once; its plain text stays in the state dir (mode 0600),
    for the client config each start writes. One revoked since (`ember token revoke`)
    is replaced by a new one: written into the config it would lock every command out."""
    path = state_dir / ADMIN_TOKEN_FILE
    token = kept_secret(path, lambda: tokens.create(Scope.ADMIN, "admin"))
    if tokens.scope_of(f"Bearer {token}") is Scope.ADMIN:
        return token
    token = tokens.create(Scope.ADMIN, "admin")
    replace_secret(path, token)
    log.warning(
        "the admin token kept in %s no longer works (revoked): a new one replaces it there "
        "and in the client config",
        path.name,
    )
    return token


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


def open_state_store(config: ServerConfig) -> StateStore:
    """The state store the config names, its schema brought up to date (ConfigError if its
    database cannot be reached)."""
    if config.database is None:
        return SqliteStateStore(config.db_path)
    try:
        from ember_platform.storage.postgres_store import PostgresStateStore
    except ImportError as exc:
        raise ConfigError(
            f"--database needs psycopg ({exc}): pip install 'ember[postgres]'"
        ) from None
    store = PostgresStateStore(config.database)
    if config.db_path.exists():
        # Nothing is copied between the two: the apps deployed before are not there.
        log.warning(
            "%s holds the state kept before --database, which this server does not use: "
            "deploy the apps again (and make their tokens and secrets), or start without "
            "--database to go back to it",
            config.db_path,
        )
    return store


def open_blob_store(config: ServerConfig) -> BlobStore:
    """The blob store the config names, checked to answer (ConfigError if it does not)."""
    if config.blob_store is None:
        return LocalBlobStore(config.blob_dir)
    from ember_platform.storage.s3_blobs import S3BlobStore

    try:
        store = S3BlobStore(config.blob_store, config.blob_s3_endpoint_url)
        store.check()
    except (ValueError, BlobStoreError) as exc:
        raise ConfigError(str(exc)) from None
    except ImportError as exc:
        raise ConfigError(
            f"--blob-store {config.blob_store} needs boto3 ({exc}): pip install boto3"
        ) from None
    if config.blob_dir.is_dir() and any(p.is_file() for p in config.blob_dir.rglob("*")):
        # Deployed apps' bundles (and images, volume files) from before are not there.
        log.warning(
            "%s holds blobs kept before --blob-store: copy them into the bucket (aws s3 "
            "sync %s %s) or deploy the apps again, else their replicas cannot start",
            config.blob_dir,
            config.blob_dir,
            config.blob_store,
        )
    return store


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


class _ControlPlaneServer(PromptShutdownServer):
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


def _keep_private(config: ServerConfig) -> None:
    """The stored bundles and the logs are root's alone: replicas, which run as other
    users, may pass through the state dir to their worker's folder (an ACL entry the
    worker adds), so what it holds must not be readable by others. Its keys, tokens and
    database are 0600 where they are written; these folders were 0755 before."""
    for folder in (config.blob_dir, config.log_dir):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(folder, 0o700)


class Server:
    """Owns one control-plane process. `await serve()` runs until `stop()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ready = asyncio.Event()
        self.info: ServerInfo | None = None
        self._uvicorn: _ControlPlaneServer | None = None
        self._channel_server: ChannelServer | None = None
        self._worker: subprocess.Popen[bytes] | None = None

    async def serve(self) -> None:
        config = self.config
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = StateDirLock(config.state_dir)
        lock.acquire()
        _keep_private(config)
        try:
            await self._serve_with_state()
        finally:
            lock.release()

    async def _serve_with_state(self) -> None:
        config = self.config
        own = None
        if config.tls_cert is not None and config.tls_key is not None:
            own = OwnCertificate(config.tls_cert, config.tls_key, config.domain)
            for warning in warnings_for(own.loaded, config.domain, dt.datetime.now(dt.UTC)):
                log.warning("%s", warning)
        otlp_problem = settings_problem(config.otlp_endpoint)
        if otlp_problem is not None:
            raise ConfigError(otlp_problem)
        if not 0 <= config.port <= MAX_PORT:
            # The CLI checks its --port too; this is for servers started from code.
            raise ConfigError(
                f"port {config.port} is not a TCP port: give one from 1 to {MAX_PORT} "
                "(or 0 to pick a free one)"
            )
        try:
            sock = _bind(config.host, config.port)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {config.host}:{config.port}: {exc.strerror}; is another "
                "ember server running? Stop it or pick another --port"
            ) from None
        port = sock.getsockname()[1]
        tls = ensure_tls(config.state_dir, hosts=[config.host], domain=config.domain)
        url = f"https://{_url_host(config.host)}:{port}"
        public_url = (config.public_url or url).rstrip("/")
        store = open_state_store(config)
        # One database, one blob store: a server started with another is refused.
        await asyncio.to_thread(
            check_blob_store,
            store,
            blob_store_identity(config.blob_store, config.blob_dir),
            shared=config.database is not None,
            move=config.move_blob_store,
        )
        tokens = TokenRegistry(store)
        admin_token = admin_token_of(config.state_dir, tokens)
        logs = LogSink(config.log_dir)
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
        await asyncio.to_thread(_warn_of_missing_bundles, cluster, blobs, config)
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
            http=limited_protocol(
                GatewayLimits(
                    max_head_bytes=config.max_head_bytes,
                    max_headers=config.max_headers,
                    head_timeout=config.head_timeout_seconds,
                    max_connections=config.max_connections,
                    max_connections_per_address=config.max_connections_per_address,
                )
            ),
        )
        uvicorn_config.load()  # makes its SSL context, which the operator's certificate joins
        renewals: asyncio.Future[None] | None = None
        if own is not None:
            assert uvicorn_config.ssl is not None  # load() made it from ssl_certfile
            own.attach(uvicorn_config.ssl)
            renewals = asyncio.ensure_future(_watch_renewals(own))
        self._uvicorn = _ControlPlaneServer(uvicorn_config, on_shutdown=api.begin_stopping)
        controller = asyncio.ensure_future(Controller(cluster).run())
        sampling = asyncio.ensure_future(sample_forever(cluster, history))
        deletes = asyncio.ensure_future(_send_failed_deletes_again(failed_deletes))
        supervisor: asyncio.Future[None] | None = None
        serving = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        channel_serving: asyncio.Future[None] | None = None
        try:
            while not self._uvicorn.started:
                if serving.done():
                    await serving  # raises what made uvicorn fail to start
                    return
                await asyncio.sleep(0.01)
            save_config(ClientConfig(url, admin_token, str(tls.ca_cert), config.domain))
            self.info = ServerInfo(
                url,
                tls.ca_cert,
                admin_token,
                own.describe() if own is not None else None,
                public_url if public_url != url else None,
            )
            if config.local_worker:
                # The local worker's channels, and its replicas', skip TCP and TLS.
                channel_socket = unix_channel.new_abstract_name()
                self._channel_server = channel_server(channels, self._uvicorn.config)
                channel_serving = asyncio.ensure_future(
                    self._channel_server.serve(sockets=[unix_channel.listen(channel_socket)])
                )
                supervisor = asyncio.ensure_future(
                    self._supervise_local_worker(url, tls, tokens, channel_socket)
                )
                await self._wait_for_worker(cluster)
            self.ready.set()
            await serving
        finally:
            controller.cancel()
            sampling.cancel()
            deletes.cancel()
            if renewals is not None:
                renewals.cancel()
            if supervisor is not None:
                supervisor.cancel()
            if channel_serving is not None and self._channel_server is not None:
                # Closed first, as the HTTPS server's channels are: replicas that lose
                # their channel exit at once, before the worker is stopped.
                self._channel_server.should_exit = True
                with contextlib.suppress(Exception):
                    await channel_serving
            self._stop_local_worker()
            await webhooks.close()
            if spans is not None:
                await spans.close()
            logs.flush()
            await asyncio.to_thread(blobs.close)  # the deletes asked for are done
            failed_deletes.collect()  # those that failed are sent again at the next start
            cluster.record_live_usage()  # the replicas end with this process
            if cluster.calls.retry():
                log.warning(
                    "stopping with %d async call records the state store would not take: "
                    "those calls' latest states are lost",
                    cluster.calls.held,
                )
            store.close()
            sock.close()

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped it (SIGINT, SIGTERM), if one did."""
        signals = self._uvicorn.signals if self._uvicorn is not None else []
        return signals[0] if signals else None

    @property
    def stopping(self) -> bool:
        """Whether this server has been asked to stop: by `stop()`, or a SIGINT or SIGTERM
        that uvicorn's handler took."""
        return self._uvicorn is not None and self._uvicorn.should_exit

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._channel_server is not None:
            self._channel_server.should_exit = True

    async def _supervise_local_worker(
        self, url: str, tls: TlsFiles, tokens: TokenRegistry, channel_socket: str
    ) -> None:
        """Keep the local worker running: restart it (with backoff) if it dies, unless
        the server is stopping (a Ctrl+C in the terminal stops the worker too)."""
        token = "emb_local_" + os.urandom(24).hex()
        tokens.add_ephemeral(token, Scope.WORKER)
        backoff = 0.2
        while True:
            started = time.monotonic()
            self._worker = self._start_local_worker(url, tls, token, channel_socket)
            while self._worker.poll() is None:
                await asyncio.sleep(0.1)
            # The worker may see the terminal's SIGINT before this process does.
            await asyncio.sleep(WORKER_EXIT_GRACE_SECONDS)
            if self.stopping:
                return
            log.error(
                "the local worker exited with code %s; restarting it", self._worker.returncode
            )
            backoff = 0.2 if time.monotonic() - started > 30 else min(backoff * 2, 10.0)
            await asyncio.sleep(backoff)
            if self.stopping:
                return

    def _start_local_worker(
        self, url: str, tls: TlsFiles, token: str, channel_socket: str
    ) -> subprocess.Popen[bytes]:
        self.config.worker_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "ember_worker",
            "--server",
            url,
            "--ca-cert",
            str(tls.ca_cert),
            "--work-dir",
            str(self.config.worker_dir),
            "--name",
            "local",
            "--channel-socket",
            channel_socket,
            "--lifeline",
        ]
        if self.config.lazy_restore:
            command.append("--lazy-restore")
        if self.config.local_worker_gpus is not None:
            command += ["--gpus", self.config.local_worker_gpus]
        command += self.config.local_worker_options
        env = {**os.environ, "EMBER_WORKER_TOKEN": token}
        # stdin is the lifeline: the worker exits when this process goes away.
        return subprocess.Popen(command, stdin=subprocess.PIPE, env=env)

    async def _wait_for_worker(self, cluster: Cluster, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not cluster.workers and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if not cluster.workers:
            log.error("the local worker has not registered after %.0f s", timeout)

    def _stop_local_worker(self) -> None:
        worker = self._worker
        if worker is None or worker.poll() is not None:
            return
        if worker.stdin is not None:
            with contextlib.suppress(OSError):
                worker.stdin.close()
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
