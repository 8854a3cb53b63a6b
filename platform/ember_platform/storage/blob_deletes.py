"""Blobs the platform deleted whose delete failed at the blob store (S3 deletes land in
the background, where a failure was only logged): kept in the state store and sent again
until they go, so that a store that was down for a while leaks nothing.

Before each delete is sent again its owner is asked whether the blob should still go: a
volume's content may be some file's again, a snapshot's key taken again since.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.state_store import StateStore, StoreWriteError

log = logging.getLogger("ember.platform")

COLLECT_EVERY_SECONDS = 30.0  # outcomes of deletes are taken in this often
RETRY_EVERY_SECONDS = 600.0  # and failed ones sent again this often

# Whether a blob whose delete failed should still go; None: the key is not its own.
Owner = Callable[[str], bool | None]


class FailedDeletes:
    """Used from the event loop's thread, as the state store is."""

    def __init__(self, store: StateStore, blobs: BlobStore, owners: list[Owner]) -> None:
        self.store = store
        self.blobs = blobs
        self.owners = owners
        self.pending: set[str] = set(store.blob_deletes())

    def collect(self) -> int:
        """Note the deletes that failed since the last call and forget those that landed;
        how many failed anew."""
        failed = 0
        for key, deleted in self.blobs.delete_outcomes():
            try:
                if deleted and key in self.pending:
                    self.store.remove_blob_delete(key)
                    self.pending.discard(key)
                elif not deleted and key not in self.pending:
                    self.store.add_blob_delete(key, time.time())
                    self.pending.add(key)
                    failed += 1
            except StoreWriteError as error:  # sent again at the next start, or not
                log.warning("could not note the delete of blob %s: %s", key, error)
        if failed:
            log.warning(
                "%d blob delete(s) failed at the blob store: sent again every %.0f s until "
                "they land",
                failed,
                RETRY_EVERY_SECONDS,
            )
        return failed

    def retry(self) -> int:
        """Send again each failed delete whose blob should still go (forgetting those
        that should not); how many were sent. Their outcomes come in by `collect`."""
        sent = 0
        for key in sorted(self.pending):
            try:
                should_go = self._should_go(key)
            except Exception as error:  # the state store failed: asked again next time
                log.warning("could not tell whether blob %s should still go: %s", key, error)
                continue
            if should_go:
                # Checked and asked in one step of the loop, before any write could
                # make the blob wanted again: the store's changes land in this order.
                self.blobs.delete(key)
                sent += 1
                continue
            try:
                self.store.remove_blob_delete(key)
                self.pending.discard(key)
            except StoreWriteError as error:
                log.warning("could not forget the delete of blob %s: %s", key, error)
        return sent

    def _should_go(self, key: str) -> bool:
        for owner in self.owners:
            verdict = owner(key)
            if verdict is not None:
                return verdict
        return False  # no owner knows it: keep it
