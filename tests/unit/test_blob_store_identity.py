"""A state database remembers its blob store: on PostgreSQL (several processes may share
it) a server with another store is refused, naming both; on SQLite (one process) the new
store is recorded with a warning; --move-blob-store moves a PostgreSQL platform on purpose."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from store_backends import StoreOpener

from ember.errors import ConfigError
from ember_platform.storage.blob_store_identity import (
    SETTING,
    blob_store_identity,
    check_blob_store,
)


def test_the_identity_of_a_bucket_and_of_a_folder(tmp_path: Path) -> None:
    same = {blob_store_identity(url, tmp_path) for url in ("s3://b/p", "s3://b/p/", "s3://b//p")}
    assert same == {"s3://b/p"}
    assert blob_store_identity("s3://b", tmp_path) == "s3://b"
    assert blob_store_identity(None, tmp_path / "x" / ".." / "blobs") == (
        f"file://{tmp_path.resolve()}/blobs"
    )


def test_a_second_store_on_a_shared_database_is_refused_naming_both(
    open_store: StoreOpener, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = open_store(), open_store()  # two processes on one database
    check_blob_store(first, "s3://models/ember", shared=True, move=False)
    check_blob_store(second, "s3://models/ember", shared=True, move=False)  # the same: fine
    with pytest.raises(ConfigError) as refused:
        check_blob_store(second, "s3://modles/ember", shared=True, move=False)
    said = str(refused.value)
    assert "this database's blob store is s3://models/ember" in said
    assert "started with s3://modles/ember" in said and "--move-blob-store" in said
    assert first.claim_setting(SETTING, "s3://other") == "s3://models/ember"  # unchanged
    with caplog.at_level(logging.WARNING):
        check_blob_store(second, "s3://new/ember", shared=True, move=True)
    assert "moves from s3://models/ember to s3://new/ember" in caplog.text
    check_blob_store(first, "s3://new/ember", shared=True, move=False)  # the store now
    with pytest.raises(ConfigError, match="blob store is s3://new/ember"):
        check_blob_store(first, "s3://models/ember", shared=True, move=False)


def test_a_single_process_database_records_a_moved_store(
    open_store: StoreOpener, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store()
    check_blob_store(store, "file:///srv/ember/blobs", shared=False, move=False)
    with caplog.at_level(logging.WARNING):
        check_blob_store(store, "s3://models/ember", shared=False, move=False)
    assert "moves from file:///srv/ember/blobs to s3://models/ember" in caplog.text
    assert open_store().claim_setting(SETTING, "s3://x") == "s3://models/ember"
