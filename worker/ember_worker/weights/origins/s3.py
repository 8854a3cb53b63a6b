"""Objects in S3 (or an S3-compatible store), through boto3: imported on first use, one
client per endpoint and region in the process, S3's error codes mapped to ours."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from ember.errors import (
    WeightsAccessDeniedError,
    WeightsError,
    WeightsNotFoundError,
    WeightsUnavailableError,
)
from ember_worker.weights.origins.origin import (
    CountedOrigin,
    FirstByte,
    ObjectVersion,
    TransientOriginError,
    changed_at_origin,
    check_total_size,
    parse_content_range,
)
from ember_worker.weights.origins.range_buffers import RangeBytes, read_into

# Connections one S3 client may keep open: more than a reader's default concurrency (16), so
# that its fetches never queue for a connection (pass max_connections for more).
S3_MAX_CONNECTIONS = 64

_S3_NOT_FOUND = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_S3_DENIED = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "Forbidden",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidToken",
        "401",
        "403",
    }
)
_S3_CHANGED = frozenset({"PreconditionFailed", "InvalidRange", "412", "416"})
_S3_TRANSIENT = frozenset(
    {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"}
)


def _parse_s3_url(url: str) -> tuple[str, str]:
    # Not urlsplit: S3 keys may contain '?' and '#', which are not a query or fragment here.
    bucket, _, key = url[len("s3://") :].partition("/")
    if not url.startswith("s3://") or not bucket or not key:
        raise WeightsError(url, "an S3 URL names a bucket and a key: s3://bucket/key")
    return bucket, key


def _s3_client_error(url: str, error: Any) -> Exception:
    """Map a botocore ClientError (the service answered) to our errors."""
    details = error.response.get("Error", {})
    code = str(details.get("Code", ""))
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    message = details.get("Message") or code or f"HTTP {status}"
    if code in _S3_NOT_FOUND or status == 404:
        return WeightsNotFoundError(url, f"not found at the origin (S3 {code or status})")
    if code in _S3_DENIED or status in (401, 403):
        return WeightsAccessDeniedError(url, f"access denied by S3 ({code}: {message})")
    if code in _S3_CHANGED or status in (412, 416):
        return changed_at_origin(url, f"S3 {code or status}")
    if code in _S3_TRANSIENT or status >= 500 or status == 429:
        return TransientOriginError(f"S3 {code} (HTTP {status}): {message}")
    return WeightsUnavailableError(url, f"S3 answered {code} (HTTP {status}): {message}")


class S3Origin(CountedOrigin):
    """An object in S3 (or an S3-compatible store), through boto3.

    Endpoint, region and credentials come from the usual AWS settings that boto3 reads
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL[_S3], AWS_DEFAULT_REGION,
    ~/.aws), unless `endpoint_url` or `region` say otherwise. `client_factory`, when given,
    makes the client instead (and then owns all of those choices).
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client_factory: Callable[[], Any] | None = None,
        max_connections: int = S3_MAX_CONNECTIONS,
    ) -> None:
        super().__init__(url)
        self.bucket, self.key = _parse_s3_url(url)
        self._endpoint_url = endpoint_url
        self._region = region
        self._client_factory = client_factory
        self._max_connections = max_connections
        self._client: Any = None
        self._client_lock = threading.Lock()

    def stat(self) -> ObjectVersion:
        self._count_stat()
        with self._s3_errors():
            head = self._s3().head_object(Bucket=self.bucket, Key=self.key)
        tag = head.get("ETag") or _iso(head.get("LastModified"))
        return ObjectVersion(size=int(head["ContentLength"]), tag=tag)

    def read_range(
        self,
        start: int,
        end: int,
        version: ObjectVersion,
        *,
        on_first_byte: FirstByte | None = None,
    ) -> RangeBytes:
        if start == end:
            return b""
        conditions = {"IfMatch": version.tag} if version.tag.startswith('"') else {}
        self._count_read()
        with self._s3_errors():
            response = self._s3().get_object(
                Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end - 1}", **conditions
            )
            if on_first_byte is not None:
                on_first_byte()  # botocore returns once the headers are in
            body = response["Body"]
            try:
                data, longer = read_into(end - start, body.readinto)
            finally:
                body.close()
        # Checked even though IfMatch asked S3 to: not every S3-compatible store honours it.
        etag = response.get("ETag")
        if etag and version.tag.startswith('"') and etag != version.tag:
            raise changed_at_origin(self.url, f"ETag {etag}, not {version.tag}")
        content_range = parse_content_range(response.get("ContentRange"))
        if content_range is not None:
            check_total_size(self.url, content_range[2], version)
        return self._deliver(data, start, end, longer=longer)

    def reset(self) -> None:
        """Close the client's connections. A closed botocore client opens new ones on
        its next call, so the (costly to build) client itself is kept."""
        with self._client_lock:
            client = self._client
        if client is not None and hasattr(client, "close"):
            client.close()

    def prepare(self) -> None:
        """Build the client now (`by_scheme.prepare`), contacting no one."""
        self._s3()

    def _s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = (
                    self._client_factory()
                    if self._client_factory is not None
                    else _shared_s3_client(self._endpoint_url, self._region, self._max_connections)
                )
            return self._client

    @contextmanager
    def _s3_errors(self) -> Iterator[None]:
        from botocore import exceptions as boto_errors

        try:
            yield
        except boto_errors.ClientError as error:
            raise _s3_client_error(self.url, error) from error
        except (boto_errors.NoCredentialsError, boto_errors.PartialCredentialsError) as error:
            raise WeightsAccessDeniedError(
                self.url, f"no usable AWS credentials: {error}"
            ) from error
        except (
            boto_errors.ConnectionError,
            boto_errors.HTTPClientError,
            boto_errors.IncompleteReadError,
        ) as error:
            raise TransientOriginError(f"{type(error).__name__}: {error}") from error


_s3_clients: dict[tuple[str | None, str | None, int], Any] = {}
_s3_clients_lock = threading.Lock()


def _shared_s3_client(endpoint_url: str | None, region: str | None, connections: int) -> Any:
    """One boto3 client per endpoint and region in this process: building one parses the
    S3 service model (about 90 ms here), and a sharded checkpoint opens many objects.
    botocore clients are thread-safe; sessions are not, so each client gets its own."""
    key = (endpoint_url, region, connections)
    with _s3_clients_lock:
        client = _s3_clients.get(key)
        if client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                max_pool_connections=connections,
                # One attempt per call: the reader retries with its own backoff and counts.
                retries={"mode": "standard", "total_max_attempts": 1},
            )
            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=config
            )
            _s3_clients[key] = client
        return client


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else ""
