"""Which blob store a state database belongs with: recorded at its first start, compared at
every later one.

A database's deployments, snapshots and volumes name blobs by key; another store lacks
them. On PostgreSQL several processes may share one database, and one started with another
`--blob-store` (a typo, a forgotten flag) would deploy into a store the others never read:
it is refused, naming both. SQLite's database has one process (the state dir's lock), so a
changed store there is the operator moving it: recorded, with a warning."""

from __future__ import annotations

import logging
from pathlib import Path

from ember.errors import ConfigError
from ember_platform.storage.s3_blobs import parse_s3_url
from ember_platform.storage.state_store import StateStore

log = logging.getLogger(__name__)

SETTING = "blob_store"


def blob_store_identity(blob_store: str | None, blob_dir: Path) -> str:
    """One spelling of a blob store: `s3://BUCKET/PREFIX` (the endpoint left out, so a new
    address of the same service is the same store), or the local folder's `file://` URL.
    Two machines' folders of the same path are not told apart."""
    if blob_store is None:
        return blob_dir.resolve().as_uri()
    bucket, prefix = parse_s3_url(blob_store)
    return f"s3://{bucket}/{prefix}".rstrip("/")


def check_blob_store(store: StateStore, identity: str, *, shared: bool, move: bool) -> None:
    """Record `identity` as the database's blob store, or check it is the one recorded
    (ConfigError naming both if not). `shared`: the database may have other processes
    (PostgreSQL). `move`: the operator says this start moves the platform to `identity`."""
    recorded = store.claim_setting(SETTING, identity)
    if recorded == identity:
        return
    if shared and not move:
        raise ConfigError(
            f"this database's blob store is {recorded}, but this server was started with "
            f"{identity}: the state's bundles, snapshot images and volume files are in "
            f"{recorded}, and every server on one database must use the same store. Start it "
            "with that store's --blob-store; or, to move the platform to the new store (its "
            "blobs copied there, or the apps to be deployed again), stop every server on "
            "this database and start one with --move-blob-store"
        )
    store.put_setting(SETTING, identity)
    log.warning(
        "the blob store moves from %s to %s: the apps deployed before run only if their "
        "blobs were copied there (else deploy them again)",
        recorded,
        identity,
    )
