"""The control plane's process: its state dir's lock, its socket and TLS files, its
signals, and the local worker, started before the rest (ember_platform.control_plane) is
loaded; then one control plane served, or turns between standby and owner on a database
several processes share (peers/peer_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

from ember.config import ClientConfig, save_config
from ember.errors import ConfigError
from ember_platform.config import ServerConfig
from ember_platform.local_worker import LocalWorker
from ember_platform.security.tls import TlsFiles, ensure_tls
from ember_platform.server_info import ServerInfo
from ember_platform.storage.state_lock import StateDirLock

if TYPE_CHECKING:
    from ember_platform.control_plane import ControlPlane
    from ember_platform.peers.leadership import Leadership
    from ember_platform.storage.blobs import BlobStore

log = logging.getLogger("ember.server")

MAX_PORT = 65535
# Those that stop the server in order (Ctrl+C, a service manager's stop).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


def _listen(config: ServerConfig) -> socket.socket:
    if not 0 <= config.port <= MAX_PORT:
        # The CLI checks its --port too; this is for servers started from code.
        raise ConfigError(
            f"port {config.port} is not a TCP port: give one from 1 to {MAX_PORT} "
            "(or 0 to pick a free one)"
        )
    try:
        return _bind(config.host, config.port)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port}: {exc.strerror}; is another "
            "ember server running? Stop it or pick another --port"
        ) from None


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _keep_private(config: ServerConfig) -> None:
    """The stored bundles and the logs are root's alone: replicas, which run as other
    users, may pass through the state dir to their worker's folder (an ACL entry the
    worker adds), so what it holds must not be readable by others. Its keys, tokens and
    database are 0600 where they are written; these folders were 0755 before."""
    for folder in (config.blob_dir, config.log_dir):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(folder, 0o700)


class Server:
    """Owns one control-plane process. `await serve()` runs until `stop()`, SIGINT or
    SIGTERM; `ready` is set, and `info` says where it serves, once it answers."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ready = asyncio.Event()
        self.info: ServerInfo | None = None
        self._stop_asked = False
        self._signals: list[int] = []  # the stop signals taken, in order
        self._plane: ControlPlane | None = None  # the control plane serving, if one is

    async def serve(self) -> None:
        config = self.config
        with self._signals_taken():
            config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock = StateDirLock(config.state_dir)
            lock.acquire()
            _keep_private(config)
            try:
                sock = _listen(config)
                try:
                    await self._serve_on(sock)
                finally:
                    sock.close()
            finally:
                lock.release()

    async def _serve_on(self, sock: socket.socket) -> None:
        config = self.config
        tls = ensure_tls(config.state_dir, hosts=[config.host], domain=config.domain)
        url = f"https://{_url_host(config.host)}:{sock.getsockname()[1]}"
        local = LocalWorker(config, url, tls.ca_cert) if config.local_worker else None
        try:
            if local is not None:
                # Started before the rest of the control plane is loaded: its own start
                # takes as long, and runs meanwhile on another core.
                local.start()
            if config.database is None:
                await self._serve_as_owner(sock, tls, url, local)
                return
            # Several processes may share the database: the one holding its lease
            # serves, the others pipe connections to it.
            from ember_platform.peers.peer_server import serve_as_peer

            async def as_owner(owned: socket.socket, lead: Leadership, blobs: BlobStore) -> None:
                await self._serve_as_owner(owned, tls, url, local, lead, blobs)

            await serve_as_peer(self, sock, tls, url, as_owner)
        finally:
            if local is not None:
                local.stop()  # when the control plane failed to start; else done already

    async def _serve_as_owner(
        self,
        sock: socket.socket,
        tls: TlsFiles,
        url: str,
        local: LocalWorker | None,
        leadership: Leadership | None = None,
        blobs: BlobStore | None = None,
    ) -> None:
        """One control plane built, served and closed, as the platform's owner."""
        from ember_platform.control_plane import ControlPlane

        plane = ControlPlane(
            self.config, sock, tls, url, local, self.announce, leadership=leadership, blobs=blobs
        )
        await plane.build()
        self._plane = plane
        if self._stop_asked:  # told to stop while it was built
            plane.stop()
        try:
            await plane.serve()
        finally:
            self._plane = None
            await plane.close()

    def announce(self, info: ServerInfo) -> None:
        """Say where this server serves: in the client config (with its admin token, once
        it has one) and `info`, then `ready`."""
        if info.admin_token:
            domain = self.config.domain
            save_config(ClientConfig(info.url, info.admin_token, str(info.ca_cert), domain))
        self.info = info
        self.ready.set()

    @property
    def announced(self) -> bool:
        return self.ready.is_set()

    @contextlib.contextmanager
    def _signals_taken(self) -> Iterator[None]:
        """The process's signals, taken here alone for the server's whole life: SIGINT and
        SIGTERM stop it in order (a second SIGINT at once, as uvicorn takes it), SIGHUP
        (with --tls-cert) serves a renewed certificate at once. Unlike uvicorn's handlers,
        these do not raise the signal again once serving ends: a SIGTERM raised then
        killed the process before its orderly stop (deletes landing, usage and call
        records written). Signals are the main thread's: an embedded server is told to
        stop by `stop()`."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        taken = [*STOP_SIGNALS, *([signal.SIGHUP] if self.config.tls_cert is not None else [])]

        def handle(sig: int, frame: FrameType | None) -> None:
            loop.call_soon_threadsafe(self._signalled, sig)

        originals = {sig: signal.signal(sig, handle) for sig in taken}
        try:
            yield
        finally:
            for sig, original in originals.items():
                signal.signal(sig, original)

    def _signalled(self, sig: int) -> None:
        if sig == signal.SIGHUP:
            if self._plane is not None:
                self._plane.renew_certificate()
            return
        at_once = self._stop_asked and sig == signal.SIGINT  # a second Ctrl+C
        self._signals.append(sig)
        self._stop(at_once=at_once)

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped it (SIGINT, SIGTERM), if one did."""
        return self._signals[0] if self._signals else None

    @property
    def stopping(self) -> bool:
        """Whether this server has been asked to stop: by `stop()`, SIGINT or SIGTERM."""
        return self._stop_asked

    def stop(self) -> None:
        self._stop(at_once=False)

    def _stop(self, *, at_once: bool) -> None:
        self._stop_asked = True
        if self._plane is not None:
            self._plane.stop(at_once=at_once)
