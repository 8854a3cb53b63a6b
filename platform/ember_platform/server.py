"""The control plane's lifecycle: its state dir's lock, its socket and TLS files, and the
local worker, started before the rest (ember_platform.control_plane) is loaded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING

from ember.errors import ConfigError
from ember_platform.config import ServerConfig
from ember_platform.local_worker import LocalWorker
from ember_platform.security.tls import ensure_tls
from ember_platform.server_info import ServerInfo
from ember_platform.storage.state_lock import StateDirLock

if TYPE_CHECKING:
    from ember_platform.control_plane import ControlPlaneServer
    from ember_platform.http.channels import ChannelServer

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
    """Owns one control-plane process. `await serve()` runs until `stop()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ready = asyncio.Event()
        self.info: ServerInfo | None = None
        self.https: ControlPlaneServer | None = None
        self.channel_server: ChannelServer | None = None
        self.stop_asked = False  # by stop(), or a signal while a standby
        self.signals: list[int] = []  # the stop signals taken while a standby

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
        local: LocalWorker | None = None
        try:
            tls = ensure_tls(config.state_dir, hosts=[config.host], domain=config.domain)
            url = f"https://{_url_host(config.host)}:{sock.getsockname()[1]}"
            if config.local_worker:
                # Started before the rest of the control plane is loaded: its own start
                # takes as long, and runs meanwhile on another core.
                local = LocalWorker(config, url, tls.ca_cert)
                local.start()
            if config.database is not None:
                # Several processes may share the database: the one holding its lease
                # serves, the others pipe connections to it (peers/peer_server.py).
                from ember_platform.peers.peer_server import serve_as_peer

                await serve_as_peer(self, sock, tls, url, local)
            else:
                from ember_platform.control_plane import serve_control_plane

                await serve_control_plane(self, sock, tls, url, local)
        finally:
            if local is not None:
                local.stop()  # when the control plane failed to start; else done already
            sock.close()

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped it (SIGINT, SIGTERM), if one did."""
        signals = [*self.signals, *(self.https.signals if self.https is not None else [])]
        return signals[0] if signals else None

    @property
    def stopping(self) -> bool:
        """Whether this server has been asked to stop: by `stop()`, or a SIGINT or SIGTERM
        that uvicorn's handler took."""
        return self.stop_asked or (self.https is not None and self.https.should_exit)

    def stop(self) -> None:
        self.stop_asked = True
        if self.https is not None:
            self.https.should_exit = True
        if self.channel_server is not None:
            self.channel_server.should_exit = True
