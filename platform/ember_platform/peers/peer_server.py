"""One of several control-plane processes on one PostgreSQL: the server's life in turns.

While another process owns the platform (holds its lease), this one is a standby: its
socket's connections are piped to the owner (`peers/standby.py`). When it takes the lease,
it stops piping and serves the socket itself as a freshly started control plane does
(deployments and spawned calls from the store; workers and replicas reconnect to it). If
it loses the lease (`Leadership.lost`), it stops at once, writing nothing more, and
becomes a standby again; an orderly stop gives the lease up so the next owner need not
wait it out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import uuid
from types import FrameType
from typing import TYPE_CHECKING

from ember.config import ClientConfig, save_config
from ember_platform.peers.leadership import Leadership
from ember_platform.peers.platform_lease import PlatformLease
from ember_platform.peers.standby import Standby
from ember_platform.server_info import ServerInfo, kept_admin_token, public_url_of
from ember_platform.storage.opening import check_blob_store_of, open_blob_store, open_state_store

if TYPE_CHECKING:
    from ember_platform.config import ServerConfig
    from ember_platform.local_worker import LocalWorker
    from ember_platform.security.tls import TlsFiles
    from ember_platform.server import Server

log = logging.getLogger("ember.server")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LEASE_TTL_WAIT = 5.0  # for the lease's first answer at start


def _check_database(config: ServerConfig) -> None:
    """What a lone server checks at start, checked before this process waits as a
    standby: the database answers (else ConfigError naming it), its schema is brought up
    to date (the leases table is in it), and its blob store is this process's."""
    store = open_state_store(config)
    try:
        check_blob_store_of(store, config)
    finally:
        store.close()


def leadership_for(server: Server, url: str) -> Leadership:
    config = server.config
    assert config.database is not None
    ttl = config.lease_ttl_seconds
    lease = PlatformLease(
        config.database,
        holder=uuid.uuid4().hex,  # this process's life: a restart is a new holder
        holder_url=(config.advertise_url or url).rstrip("/"),
        ttl=ttl,
        margin=ttl / 4,
    )
    return Leadership(lease, interval=ttl / 8)


def _announce(server: Server, tls: TlsFiles, url: str) -> None:
    """What a freshly started server says, for a process that starts as a standby."""
    token = kept_admin_token(server.config.state_dir)
    if token:
        save_config(ClientConfig(url, token, str(tls.ca_cert), server.config.domain))
    public = public_url_of(server.config, url)
    server.info = ServerInfo.of(url, tls.ca_cert, token, public)
    server.ready.set()


class _StopSignals:
    """SIGINT and SIGTERM while a standby: noted, and the server told to stop. (The
    owner's HTTPS server takes them while this process owns the platform.)"""

    def __init__(self, server: Server) -> None:
        self.server = server
        self._loop = asyncio.get_running_loop()
        self._originals: dict[int, object] = {}

    def __enter__(self) -> _StopSignals:
        with contextlib.suppress(ValueError):  # not the main thread: an embedded server
            for sig in STOP_SIGNALS:
                self._originals[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        self.server.signals.append(sig)
        self._loop.call_soon_threadsafe(self.server.stop)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._originals.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


async def _until_held_or_stopped(server: Server, leadership: Leadership) -> bool:
    while not server.stop_asked:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leadership.held.wait(), 0.1)
            return True
    return False


async def serve_as_peer(
    server: Server, sock: socket.socket, tls: TlsFiles, url: str, local: LocalWorker | None
) -> None:
    from ember_platform.control_plane import serve_control_plane

    await asyncio.to_thread(_check_database, server.config)
    leadership = leadership_for(server, url)
    owner_url = leadership.lease.holder_url
    leadership.start()
    fenced = False
    try:
        with _StopSignals(server):
            while not server.stop_asked:
                standby = Standby(
                    sock,
                    lambda: leadership.owner_url,
                    leadership.owner_known,
                    own_url=owner_url,
                    hold_seconds=server.config.standby_hold_seconds,
                )
                await standby.start()
                # Opened (its client made, the bucket checked) while waiting, not after
                # the takeover: a tenth of a second or more.
                blobs = await asyncio.to_thread(open_blob_store, server.config)
                if not server.ready.is_set():
                    # A process that takes the lease at once starts as a lone server does.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(leadership.answered.wait(), LEASE_TTL_WAIT)
                    if not leadership.held.is_set():
                        _announce(server, tls, url)
                held = await _until_held_or_stopped(server, leadership)
                await standby.stop()
                if not held:
                    await asyncio.to_thread(blobs.close)
                    break
                # The owner's server closes the socket it is given when it stops: a
                # duplicate, so the next turn's standby has the socket still.
                fences = leadership.fences
                await serve_control_plane(
                    server, sock.dup(), tls, url, local, leadership, blobs=blobs
                )
                # Counted, not read from `lost`: a lease taken again meanwhile clears it.
                fenced = leadership.fences > fences
                if server.https is not None and server.https.signals:
                    server.signals.extend(server.https.signals)
                    server.stop_asked = True
                if not fenced:
                    break  # stopped in order (a signal, or `stop()`)
                server.https = None
                log.warning("this process is a standby again")
    finally:
        await leadership.stop(release=not fenced)
