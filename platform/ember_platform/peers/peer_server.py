"""One of several control-plane processes on one PostgreSQL: the server's life in turns.

While another process owns the platform (holds its lease), this one is a standby: its
socket's connections are piped to the owner (`peers/standby.py`). When it takes the lease,
it stops piping and serves the socket itself as a freshly started control plane does
(deployments and spawned calls from the store; workers and replicas reconnect to it). If
it loses the lease (`Leadership.lost`), it stops at once, writing nothing more, and
becomes a standby again; an orderly stop gives the lease up so the next owner need not
wait it out. The server whose turns these are (`Server`, in server.py) lends them what
`Host` names, and its control plane as `serve_as_owner`: nothing here imports either."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from ember_platform.config import ServerConfig
from ember_platform.peers.app_leases import AppLeases
from ember_platform.peers.app_ownership import AppOwnership
from ember_platform.peers.leadership import Leadership
from ember_platform.peers.platform_lease import PlatformLease
from ember_platform.peers.standby import Standby
from ember_platform.server_info import ServerInfo, kept_admin_token, public_url_of
from ember_platform.store_opening import check_blob_store_of, open_blob_store, open_state_store

if TYPE_CHECKING:
    from ember_platform.security.tls import TlsFiles
    from ember_platform.storage.blobs import BlobStore

log = logging.getLogger("ember.server")

LEASE_TTL_WAIT = 5.0  # for the lease's first answer at start

# One turn as the platform's owner: a control plane served on the socket given (closed
# when it stops) until it stops in order or the lease is lost.
ServeAsOwner = Callable[[socket.socket, Leadership, "BlobStore"], Awaitable[None]]


class Host(Protocol):
    """What the server whose turns these are lends them."""

    @property
    def config(self) -> ServerConfig: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def announced(self) -> bool: ...

    def announce(self, info: ServerInfo) -> None: ...


def _check_database(config: ServerConfig) -> None:
    """What a lone server checks at start, checked before this process waits as a
    standby: the database answers (else ConfigError naming it), its schema is brought up
    to date (the leases table is in it), and its blob store is this process's."""
    store = open_state_store(config)
    try:
        check_blob_store_of(store, config)
    finally:
        store.close()


def leadership_for(config: ServerConfig, url: str) -> Leadership:
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


def app_ownership_for(lease: PlatformLease) -> AppOwnership:
    """The apps' leases of the process that holds (or waits for) `lease`, as the same holder."""
    ttl = lease.ttl
    leases = AppLeases(lease.db.url, lease.holder, lease.holder_url, ttl=ttl, margin=ttl / 4)
    # Renewed every quarter of the ttl (three tries in time): a round is one statement,
    # but every process runs them, standbys too.
    return AppOwnership(leases, interval=ttl / 4)


def _standby_info(config: ServerConfig, tls: TlsFiles, url: str) -> ServerInfo:
    """What a freshly started server says, for a process that starts as a standby."""
    token = kept_admin_token(config.state_dir)
    return ServerInfo.of(url, tls.ca_cert, token, public_url_of(config, url))


async def _until_held_or_stopped(host: Host, leadership: Leadership) -> bool:
    while not host.stopping:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leadership.held.wait(), 0.1)
            return True
    return False


async def serve_as_peer(
    host: Host, sock: socket.socket, tls: TlsFiles, url: str, serve_as_owner: ServeAsOwner
) -> None:
    config = host.config
    await asyncio.to_thread(_check_database, config)
    leadership = leadership_for(config, url)
    owner_url = leadership.lease.holder_url
    leadership.start()
    # Every process, owner or standby, takes its share of the apps' leases: the spread
    # endpoints' ownership (docs/operations.md says what acts on it so far).
    ownership = app_ownership_for(leadership.lease)
    ownership.start()
    fenced = False
    try:
        while not host.stopping:
            standby = Standby(
                sock,
                lambda: leadership.owner_url,
                leadership.owner_known,
                own_url=owner_url,
                hold_seconds=config.standby_hold_seconds,
            )
            await standby.start()
            # Opened (its client made, the bucket checked) while waiting, not after
            # the takeover: a tenth of a second or more.
            blobs = await asyncio.to_thread(open_blob_store, config)
            if not host.announced:
                # A process that takes the lease at once starts as a lone server does.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(leadership.answered.wait(), LEASE_TTL_WAIT)
                if not leadership.held.is_set():
                    host.announce(_standby_info(config, tls, url))
            held = await _until_held_or_stopped(host, leadership)
            await standby.stop()
            if not held:
                await asyncio.to_thread(blobs.close)
                break
            # The owner's server closes the socket it is given when it stops: a
            # duplicate, so the next turn's standby has the socket still.
            fences = leadership.fences
            await serve_as_owner(sock.dup(), leadership, blobs)
            # Counted, not read from `lost`: a lease taken again meanwhile clears it.
            fenced = leadership.fences > fences
            if not fenced:
                break  # stopped in order (a signal, or `stop()`)
            log.warning("this process is a standby again")
    finally:
        await ownership.stop(leave=True)  # always: it gives up only rows still its own
        await leadership.stop(release=not fenced)
