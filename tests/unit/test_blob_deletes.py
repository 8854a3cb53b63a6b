"""FailedDeletes: deletes the blob store failed are kept and sent again, unless their
blob is wanted again meanwhile; those that land are forgotten."""

from __future__ import annotations

from pathlib import Path

from store_backends import StoreOpener

from ember_platform.storage.blob_deletes import FailedDeletes
from ember_platform.storage.blobs import LocalBlobStore


class ReportingBlobStore(LocalBlobStore):
    """Deletes land (or fail, for the keys in `failing`) as a background store's do:
    their outcomes are told by `delete_outcomes`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.failing: set[str] = set()
        self.outcomes: list[tuple[str, bool]] = []

    def delete(self, key: str) -> None:
        if key not in self.failing:
            super().delete(key)
        self.outcomes.append((key, key not in self.failing))

    def delete_outcomes(self) -> list[tuple[str, bool]]:
        taken, self.outcomes = self.outcomes, []
        return taken


def test_failed_deletes_are_kept_sent_again_and_forgotten_once_landed(
    tmp_path: Path, open_store: StoreOpener
) -> None:
    store = open_store()
    blobs = ReportingBlobStore(tmp_path / "blobs")
    wanted: set[str] = set()
    owners = [lambda key: (key not in wanted) if key.startswith("mine/") else None]
    for key in ("mine/a", "mine/b", "other/c"):
        blobs.put(key, b"x")
    blobs.failing = {"mine/a", "mine/b", "other/c"}
    deletes = FailedDeletes(store, blobs, owners)
    for key in ("mine/a", "mine/b", "other/c"):
        blobs.delete(key)
    assert deletes.collect() == 3
    # Kept across a restart, in the state store.
    deletes = FailedDeletes(store, blobs, owners)
    assert deletes.pending == {"mine/a", "mine/b", "other/c"}
    blobs.failing = {"mine/b"}  # the store is back for one of them
    wanted.add("mine/a")  # in use again: it must not go
    assert deletes.retry() == 1  # only mine/b; other/c has no owner, so it is kept
    assert deletes.pending == {"mine/b"}
    assert blobs.exists("mine/a") and blobs.exists("other/c")
    assert deletes.collect() == 0  # mine/b failed again, and was already noted
    blobs.failing = set()
    deletes.retry()
    deletes.collect()
    assert deletes.pending == set() and store.blob_deletes() == []
    assert not blobs.exists("mine/b")


def test_a_delete_that_lands_after_failing_once_is_forgotten(
    tmp_path: Path, open_store: StoreOpener
) -> None:
    store = open_store()
    blobs = ReportingBlobStore(tmp_path / "blobs")
    deletes = FailedDeletes(store, blobs, [lambda key: True])
    blobs.outcomes = [("k", False), ("k", True)]  # in the order they landed
    deletes.collect()
    assert deletes.pending == set() and store.blob_deletes() == []
