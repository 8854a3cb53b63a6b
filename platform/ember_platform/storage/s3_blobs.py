"""Blobs in an S3 bucket (AWS, or any S3 API: MinIO, Ceph, R2), for a control plane whose
bundles, snapshot images and volume files must outlive its own disk.

Every call goes through boto3 in a thread of this store's: callers on the event loop
wrap the blocking ones in `asyncio.to_thread`. What changes the bucket (a put's last
step, a delete, a rename) runs on one thread of its own in the order it was asked for,
so a delete that returns at once (`delete` is called from synchronous paths) still lands
before a later put of the same key, and never after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar, cast

from ember_platform.storage.blobs import KEY_PATTERN

log = logging.getLogger("ember.platform")

# Parts of a multipart upload: S3 wants at least 5 MiB for every part but the last, and
# at most 10,000 parts (80 GB at this size, beyond any image the platform takes).
PART_BYTES = 8 * 1024 * 1024
# How long a presigned download may take to start (it then runs to its end).
DIRECT_URL_SECONDS = 600
# A bucket that stops answering fails a call in about a minute at most (three tries of
# 5 s to connect and 20 s for each read), not botocore's default of 60 s each, five
# times: a replica start or a deploy waiting on it is told, and can fall back, in time.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0
MAX_ATTEMPTS = 3
T = TypeVar("T")


class BlobStoreError(Exception):
    """The bucket cannot be used: missing, unreachable, or the credentials are refused."""


class BlobStoreUnavailable(BlobStoreError):
    """A call to the bucket failed (unreachable, timed out, refused): the API answers 503,
    and the caller may try again."""


@contextlib.contextmanager
def _failures(url: str, what: str) -> Iterator[None]:
    """Whatever botocore raises in the block, as BlobStoreUnavailable naming the store;
    the platform's own errors (a key, a size limit) pass as they are."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as exc:
        raise BlobStoreUnavailable(f"the blob store {url} failed to {what}: {exc}") from exc


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket[/prefix]` -> (bucket, prefix ending in "/" or empty)."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r} is not an s3:// URL; write s3://BUCKET or s3://BUCKET/PREFIX")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; write s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def _missing(error: BaseException | None) -> bool:
    """Whether a botocore ClientError says the object is not there."""
    response = getattr(error, "response", None)
    code = str((response or {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


class S3BlobStore:
    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        client: Any = None,
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client(
                "s3",
                endpoint_url=endpoint_url,
                config=Config(
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    retries={"total_max_attempts": max_attempts, "mode": "standard"},
                ),
            )
        self.client = client
        self._changes = ThreadPoolExecutor(1, "ember-blob-changes")  # in the order asked
        # Of the deletes landed, for the caller to keep those that failed (blob_deletes.py).
        self._outcomes: collections.deque[tuple[str, bool]] = collections.deque(maxlen=100_000)

    def check(self) -> None:
        """BlobStoreError unless the bucket answers to these credentials (at server start)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            raise BlobStoreError(
                f"cannot use the blob store {self.url}: {exc} (is the bucket there and "
                "reachable, and do AWS_ACCESS_KEY_ID / AWS_PROFILE give access to it? Give "
                "--blob-s3-endpoint-url for an S3 API other than AWS's)"
            ) from exc

    def _key(self, key: str) -> str:
        if not KEY_PATTERN.match(key) or ".." in key:
            raise ValueError(f"invalid blob key {key!r}")
        return self.prefix + key

    def _change(self, work: Callable[[], T]) -> Future[T]:
        return self._changes.submit(work)

    def put(self, key: str, data: bytes) -> None:
        name = self._key(key)
        with _failures(self.url, f"store {key}"):
            self._change(
                lambda: self.client.put_object(Bucket=self.bucket, Key=name, Body=data)
            ).result()

    async def put_chunks(self, key: str, chunks: AsyncIterator[bytes], limit: int) -> int:
        """A multipart upload, one part in flight while the next arrives; the object
        exists only once complete. Over `limit`, or on any error, the upload is aborted
        and nothing is left in the bucket."""
        name = self._key(key)
        size = 0
        pending = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        number = 0  # of the last part sent
        sending: asyncio.Future[Any] | None = None

        def send(number: int, body: bytes) -> None:
            answer = self.client.upload_part(
                Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number, Body=body
            )
            parts.append({"PartNumber": number, "ETag": answer["ETag"]})

        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise ValueError(f"blob {key} is over the limit of {limit} bytes")
                pending += chunk
                if len(pending) >= PART_BYTES:
                    if upload_id is None:
                        created = await asyncio.to_thread(
                            self.client.create_multipart_upload, Bucket=self.bucket, Key=name
                        )
                        upload_id = str(created["UploadId"])
                    if sending is not None:
                        await sending
                    number += 1
                    body, pending = bytes(pending), bytearray()
                    sending = asyncio.ensure_future(asyncio.to_thread(send, number, body))
            if sending is not None:
                await sending
                sending = None
            if upload_id is None:  # small: one request
                await asyncio.wrap_future(
                    self._change(
                        lambda: self.client.put_object(
                            Bucket=self.bucket, Key=name, Body=bytes(pending)
                        )
                    )
                )
                return size
            if pending:
                await asyncio.to_thread(send, number + 1, bytes(pending))
            done_id = upload_id  # parts went one after another: they are in order
            await asyncio.wrap_future(
                self._change(
                    lambda: self.client.complete_multipart_upload(
                        Bucket=self.bucket,
                        Key=name,
                        UploadId=done_id,
                        MultipartUpload={"Parts": parts},
                    )
                )
            )
            upload_id = None
        except BaseException as exc:
            if sending is not None:
                await asyncio.gather(sending, return_exceptions=True)
            if upload_id is not None:
                await asyncio.to_thread(self._abort, name, upload_id)
            with _failures(self.url, f"store {key}"):
                raise exc
        return size

    def _abort(self, name: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
        except Exception as exc:  # the bucket's lifecycle rules are the last resort
            log.warning("could not abort the upload of %s: %s", name, exc)

    def get(self, key: str) -> bytes | None:
        handle = self.open(key)
        if handle is None:
            return None
        with handle:
            return handle.read()

    def open(self, key: str) -> BinaryIO | None:
        name = self._key(key)
        try:
            with _failures(self.url, f"read {key}"):
                answer = self.client.get_object(Bucket=self.bucket, Key=name)
        except BlobStoreUnavailable as exc:
            if _missing(exc.__cause__):
                return None
            raise
        return cast(BinaryIO, answer["Body"])  # botocore's StreamingBody: read(n), close()

    def direct_url(self, key: str, seconds: int = DIRECT_URL_SECONDS) -> str | None:
        """A presigned GET of the blob, valid for `seconds`: a worker downloads a snapshot
        image from the bucket itself rather than through the control plane."""
        return str(
            self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._key(key)},
                ExpiresIn=seconds,
            )
        )

    def exists(self, key: str) -> bool:
        name = self._key(key)
        try:
            with _failures(self.url, f"look up {key}"):
                self.client.head_object(Bucket=self.bucket, Key=name)
        except BlobStoreUnavailable as exc:
            if _missing(exc.__cause__):
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        """Returns at once; the delete lands before any change asked for after it."""
        name = self._key(key)

        def delete() -> None:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=name)
            except Exception as exc:
                log.warning("could not delete blob %s from %s: %s", name, self.url, exc)
                self._outcomes.append((key, False))
            else:
                self._outcomes.append((key, True))

        self._change(delete)

    def delete_outcomes(self) -> list[tuple[str, bool]]:
        taken = []
        while self._outcomes:
            taken.append(self._outcomes.popleft())
        return taken

    def listing(self, prefix: str) -> list[tuple[str, float]]:
        found = []
        with _failures(self.url, f"list {prefix}"):
            pages = self.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                found += [
                    (str(o["Key"])[len(self.prefix) :], o["LastModified"].timestamp())
                    for o in page.get("Contents", [])
                ]
        return sorted(found)

    def rename(self, key: str, new_key: str) -> None:
        """A copy (multipart for large objects), then the delete of the old key."""
        source, target = self._key(key), self._key(new_key)

        def rename() -> None:
            self.client.copy({"Bucket": self.bucket, "Key": source}, self.bucket, target)
            self.client.delete_object(Bucket=self.bucket, Key=source)

        with _failures(self.url, f"rename {key}"):
            self._change(rename).result()

    def close(self) -> None:
        """Waits for the changes already asked for."""
        self._changes.shutdown(wait=True)
