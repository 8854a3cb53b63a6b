"""The Batch API's files: their bytes a blob each (`openai-files/{id}`), their records in
the state store, each of the endpoint it was uploaded to (or a batch of it made).

Blob reads and writes block: callers on the event loop run them in a thread."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ember_platform.security.random_ids import random_bytes
from ember_platform.storage.blobs import BlobStore
from ember_platform.storage.records import OpenAIFileRecord
from ember_platform.storage.state_store import StateStore

BLOB_PREFIX = "openai-files/"
MAX_MADE_BYTES = 1 << 40  # an output file: 50,000 results of at most 64 MiB fit


def new_file_id() -> str:
    return "file-" + random_bytes(12).hex()


class OpenAIFiles:
    def __init__(self, store: StateStore, blobs: BlobStore) -> None:
        self.store = store
        self.blobs = blobs

    def add(
        self, label: str, purpose: str, filename: str, data: bytes, file_id: str | None = None
    ) -> OpenAIFileRecord:
        """Stored, bytes first: a record never names a blob that is not there."""
        record = OpenAIFileRecord(
            file_id or new_file_id(), label, purpose, filename, len(data), time.time()
        )
        self.blobs.put(BLOB_PREFIX + record.id, data)
        self.store.put_openai_file(record)
        return record

    async def add_lines(
        self, label: str, purpose: str, filename: str, lines: AsyncIterator[bytes]
    ) -> OpenAIFileRecord | None:
        """A file made of `lines` as they come, its bytes stored (its record is the
        caller's to store); None, and nothing kept, when there are none."""
        file_id = new_file_id()
        key = BLOB_PREFIX + file_id
        size = await self.blobs.put_chunks(key, lines, MAX_MADE_BYTES)
        if size == 0:
            self.blobs.delete(key)
            return None
        return OpenAIFileRecord(file_id, label, purpose, filename, size, time.time())

    def of(self, label: str, file_id: str) -> OpenAIFileRecord | None:
        """The file, if it is this endpoint's (another's is as good as absent)."""
        record = self.store.get_openai_file(file_id)
        return record if record is not None and record.label == label else None

    def content(self, record: OpenAIFileRecord) -> bytes:
        data = self.blobs.get(BLOB_PREFIX + record.id)
        if data is None:
            raise FileNotFoundError(f"the bytes of {record.id} are gone from the blob store")
        return data

    def delete(self, record: OpenAIFileRecord) -> None:
        self.store.delete_openai_file(record.id)
        self.blobs.delete(BLOB_PREFIX + record.id)
