"""The stores a server's configuration names, opened and checked: the state store (SQLite
in the state dir, or --database), the blob store (the state dir's folder, or
--blob-store), and that the two belong together. A lone server opens them at start, a
server on PostgreSQL before it waits as a standby."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ember.errors import ConfigError
from ember_platform.config import ServerConfig
from ember_platform.storage.blob_store_identity import blob_store_identity, check_blob_store

if TYPE_CHECKING:
    from ember_platform.storage.blobs import BlobStore
    from ember_platform.storage.state_store import StateStore

log = logging.getLogger("ember.server")


def open_state_store(config: ServerConfig) -> StateStore:
    """The state store the config names, its schema brought up to date (ConfigError if its
    database cannot be reached)."""
    if config.database is None:
        from ember_platform.storage.sqlite_store import SqliteStateStore

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
    from ember_platform.storage.blobs import LocalBlobStore
    from ember_platform.storage.s3_blobs import BlobStoreError, S3BlobStore

    if config.blob_store is None:
        return LocalBlobStore(config.blob_dir)
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


def check_blob_store_of(store: StateStore, config: ServerConfig) -> None:
    """One database, one blob store: the blob store the config names is recorded as the
    database's at its first start, and checked against the one recorded at every later
    start (ConfigError naming both, on a database several processes may share)."""
    check_blob_store(
        store,
        blob_store_identity(config.blob_store, config.blob_dir),
        shared=config.database is not None,
        move=config.move_blob_store,
    )
