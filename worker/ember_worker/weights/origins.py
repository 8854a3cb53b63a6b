"""Origins: where an object named by URL really lives (S3, HTTP(S), a local file).

An origin answers two questions: which version of the object is there now (`stat`), and what
are bytes [start, end) of exactly that version (`read_range`, which also tells through
`on_first_byte` when the answer began to arrive: the reader sizes its requests by that).
Failures worth retrying (a connection error, a 5xx, a short read) are `TransientOriginError`,
which the reader retries; everything else is one of the `ember.errors` weights errors,
naming the URL.

boto3, fsspec and aiohttp are imported on first use, so that a process reading only local
files or only HTTP does not pay for (or need) the other clients.
"""

from __future__ import annotations

import mmap
import os
import stat as stat_mode
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from ember.errors import (
    WeightsAccessDeniedError,
    WeightsChangedError,
    WeightsError,
    WeightsNotFoundError,
    WeightsUnavailableError,
)
from ember_worker.weights.range_buffers import RangeBytes, allocate, read_into

SUPPORTED_SCHEMES = ("s3", "http", "https", "file")

# Connections one S3 client may keep open: more than a reader's default concurrency (16), so
# that its fetches never queue for a connection (pass max_connections for more).
S3_MAX_CONNECTIONS = 64

FirstByte = Callable[[], None]


@dataclass(frozen=True)
class ObjectVersion:
    """One version of an object: its size, and a tag that changes whenever its content does
    (S3 and HTTP: the ETag, else Last-Modified; a local file: f"{size}-{mtime_ns}")."""

    size: int
    tag: str


class TransientOriginError(Exception):
    """A failure worth retrying: a connection error, a 5xx, or fewer bytes than asked.
    Not public: the reader turns it into `WeightsUnavailableError` when retries run out."""


class Origin(Protocol):
    """Reads one object by byte range, always of the version `stat` returned."""

    url: str

    @property
    def requests(self) -> int:
        """Range reads sent to the origin so far (every attempt, failed ones too)."""
        ...

    @property
    def bytes_read(self) -> int:
        """Bytes of content the origin delivered in full ranges."""
        ...

    def stat(self) -> ObjectVersion: ...

    def read_range(
        self,
        start: int,
        end: int,
        version: ObjectVersion,
        *,
        on_first_byte: FirstByte | None = None,
    ) -> RangeBytes:
        """Bytes [start, end) of `version`; `on_first_byte()` is called, from any thread,
        when the answer's headers have arrived (origins without a wait need not call it)."""
        ...

    def reset(self) -> None:
        """Close clients and connections (before a snapshot; after a restore they are dead).
        The next read opens new ones."""
        ...


def open_origin(url: str, *, s3_endpoint_url: str | None = None) -> Origin:
    """The origin for a URL, chosen by its scheme."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "s3":
        return S3Origin(url, endpoint_url=s3_endpoint_url)
    if scheme in ("http", "https"):
        return FsspecOrigin(url)
    if scheme == "file":
        return FileOrigin(url)
    supported = ", ".join(f"{name}://" for name in SUPPORTED_SCHEMES)
    raise WeightsError(url, f"unsupported URL scheme {scheme!r}; supported: {supported}")


def prepare(url: str, *, s3_endpoint_url: str | None = None) -> None:
    """Do now, without contacting the origin, the set-up that reading `url` needs: import
    its client library and, for S3, build the process's shared client (0.1-0.3 s in all).
    A replica does it before its snapshot, so that a restored one's first read skips it."""
    origin = open_origin(url, s3_endpoint_url=s3_endpoint_url)
    if isinstance(origin, S3Origin):
        origin._s3()
    elif isinstance(origin, FsspecOrigin):
        origin._filesystem()


class _CountedOrigin:
    """Thread-safe counts of what an origin was asked, so tests and stats can tell how many
    fetches really happened. `stat_requests` counts version checks (HEAD and the like)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._count_lock = threading.Lock()
        self._requests = 0
        self._stat_requests = 0
        self._bytes_read = 0

    @property
    def requests(self) -> int:
        with self._count_lock:
            return self._requests

    @property
    def stat_requests(self) -> int:
        with self._count_lock:
            return self._stat_requests

    @property
    def bytes_read(self) -> int:
        with self._count_lock:
            return self._bytes_read

    def _count_read(self) -> None:
        with self._count_lock:
            self._requests += 1

    def _count_stat(self) -> None:
        with self._count_lock:
            self._stat_requests += 1

    def _deliver(
        self, data: RangeBytes, start: int, end: int, *, longer: bool = False
    ) -> RangeBytes:
        """The asked bytes, counted; a short answer (truncated object, cut connection) is
        transient, since the next attempt may well get everything."""
        wanted = end - start
        if len(data) < wanted:
            raise TransientOriginError(
                f"short read: got {len(data)} of {wanted} bytes at offset {start}"
            )
        if len(data) > wanted or longer:
            sent = f"more than {wanted}" if longer else str(len(data))
            raise WeightsUnavailableError(
                self.url, f"the origin sent {sent} bytes for a range of {wanted}"
            )
        with self._count_lock:
            self._bytes_read += wanted
        return data


def _changed(url: str, what: str) -> WeightsChangedError:
    return WeightsChangedError(url, f"the object changed at the origin while being read ({what})")


def _check_total_size(url: str, total: int | None, version: ObjectVersion) -> None:
    if total is not None and total != version.size:
        raise _changed(url, f"its size is now {total} bytes, not {version.size}")


def _parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """`bytes first-last/total` (total may be `*`) -> (first, last, total); None if malformed."""
    if value is None:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes":
        return None
    try:
        return int(first), int(last), None if total == "*" else int(total)
    except ValueError:
        return None


# ----------------------------------------------------------------------------------------------
# S3


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
        return _changed(url, f"S3 {code or status}")
    if code in _S3_TRANSIENT or status >= 500 or status == 429:
        return TransientOriginError(f"S3 {code} (HTTP {status}): {message}")
    return WeightsUnavailableError(url, f"S3 answered {code} (HTTP {status}): {message}")


class S3Origin(_CountedOrigin):
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
            raise _changed(self.url, f"ETag {etag}, not {version.tag}")
        content_range = _parse_content_range(response.get("ContentRange"))
        if content_range is not None:
            _check_total_size(self.url, content_range[2], version)
        return self._deliver(data, start, end, longer=longer)

    def reset(self) -> None:
        """Close the client's connections. A closed botocore client opens new ones on
        its next call, so the (costly to build) client itself is kept."""
        with self._client_lock:
            client = self._client
        if client is not None and hasattr(client, "close"):
            client.close()

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


# ----------------------------------------------------------------------------------------------
# HTTP(S), through fsspec


@dataclass(frozen=True)
class _RangedResponse:
    status: int
    reason: str
    content_range: str | None
    content_length: str | None
    tag: str
    body: RangeBytes
    longer: bool  # the body went on past the range asked for


def _http_tag(headers: Any) -> str:
    """The version tag a response carries: its ETag, else its Last-Modified."""
    return str(headers.get("ETag") or headers.get("Last-Modified") or "")


async def _ranged_get(
    fs: Any, url: str, start: int, buffer: bytearray | mmap.mmap, on_first_byte: FirstByte | None
) -> _RangedResponse:
    """One ranged GET, of len(buffer) bytes into `buffer`, through the filesystem's own
    aiohttp session. Unlike `fs.cat_file` it keeps the response headers, so the version
    is checked without a HEAD per chunk."""
    end = start + len(buffer)
    session = await fs.set_session()
    # identity: a compressed answer would have other lengths and a weak ETag.
    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    async with session.get(fs.encode_url(url), headers=headers) as response:
        if on_first_byte is not None:
            on_first_byte()
        ok = response.status in (200, 206)
        body, longer = await _read_body(response.content, buffer) if ok else (b"", False)
        return _RangedResponse(
            status=response.status,
            reason=str(response.reason or ""),
            content_range=response.headers.get("Content-Range"),
            content_length=response.headers.get("Content-Length"),
            tag=_http_tag(response.headers),
            body=body,
            longer=longer,
        )


async def _read_body(content: Any, buffer: bytearray | mmap.mmap) -> tuple[RangeBytes, bool]:
    """An aiohttp body into `buffer` (range_buffers.read_into's answer)."""
    size = len(buffer)
    done, longer = 0, False
    with memoryview(buffer) as view:
        async for chunk in content.iter_any():
            take = min(len(chunk), size - done)
            view[done : done + take] = chunk[:take]
            done += take
            if take < len(chunk):
                longer = True
                break
        if done < size:
            return bytes(view[:done]), False
    return buffer, longer


def _http_status_error(url: str, status: int, reason: str) -> Exception:
    if status in (404, 410):
        return WeightsNotFoundError(url, f"not found at the origin (HTTP {status})")
    if status in (401, 403):
        return WeightsAccessDeniedError(url, f"access denied (HTTP {status} {reason})".strip())
    if status in (412, 416):
        return _changed(url, f"HTTP {status}")
    if status in (408, 429) or status >= 500:
        return TransientOriginError(f"HTTP {status} {reason}".strip())
    return WeightsUnavailableError(url, f"unexpected answer HTTP {status} {reason}".strip())


def _http_failure(url: str, error: BaseException | None) -> Exception:
    """Map what fsspec's `info` failed with (it wraps every failure in FileNotFoundError and
    keeps the real one as the cause)."""
    import aiohttp

    if error is None:
        return WeightsNotFoundError(url, "not found at the origin")
    if isinstance(error, aiohttp.ClientResponseError):
        return _http_status_error(url, error.status, str(error.message))
    if isinstance(error, aiohttp.ClientError | TimeoutError | OSError):
        return TransientOriginError(f"{type(error).__name__}: {error}")
    return WeightsUnavailableError(url, f"{type(error).__name__}: {error}")


class FsspecOrigin(_CountedOrigin):
    """An object on an HTTP(S) server, through fsspec's HTTP filesystem (aiohttp).

    `stat` is fsspec's `info` (one HEAD). Each range is one GET whose ETag (or Last-Modified)
    and Content-Range total are compared with the version: no HEAD per chunk. If-Match is
    not sent, since servers that redirect to a CDN may tag the two hops differently.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        if urlsplit(url).scheme.lower() not in ("http", "https"):
            raise WeightsError(url, "FsspecOrigin reads http:// and https:// URLs")
        self._fs: Any = None
        self._fs_lock = threading.Lock()

    def stat(self) -> ObjectVersion:
        import aiohttp

        self._count_stat()
        try:
            info = self._filesystem().info(self.url)
        except FileNotFoundError as error:
            raise _http_failure(self.url, error.__cause__) from error
        except (aiohttp.ClientError, TimeoutError) as error:
            raise _http_failure(self.url, error) from error
        size = info.get("size")
        if size is None:
            raise WeightsUnavailableError(self.url, "the server does not tell the object's size")
        return ObjectVersion(size=int(size), tag=_http_tag(info))

    def read_range(
        self,
        start: int,
        end: int,
        version: ObjectVersion,
        *,
        on_first_byte: FirstByte | None = None,
    ) -> RangeBytes:
        import aiohttp
        from fsspec.asyn import sync

        if start == end:
            return b""
        fs = self._filesystem()
        self._count_read()
        try:
            # The buffer is made here, not on fsspec's one event-loop thread: its pages are
            # faulted in by the reader's threads, side by side.
            buffer = allocate(end - start)
            response = sync(fs.loop, _ranged_get, fs, self.url, start, buffer, on_first_byte)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
            raise TransientOriginError(f"{type(error).__name__}: {error}") from error
        if response.status not in (200, 206):
            raise _http_status_error(self.url, response.status, response.reason)
        if response.tag and version.tag and response.tag != version.tag:
            raise _changed(self.url, f"version {response.tag}, not {version.tag}")
        if response.status == 206:
            self._check_content_range(response.content_range, start, end, version)
        else:
            self._check_whole_object(response.content_length, start, end, version)
        return self._deliver(response.body, start, end, longer=response.longer)

    def reset(self) -> None:
        with self._fs_lock:
            fs, self._fs = self._fs, None
        # Closed now, not when the old filesystem is collected: a snapshot taken next must
        # not find open connections. fsspec keeps the session in `_session`.
        session = getattr(fs, "_session", None)
        if fs is not None and session is not None:
            fs.close_session(fs.loop, session)

    def _filesystem(self) -> Any:
        with self._fs_lock:
            if self._fs is None:
                import fsspec

                # An instance of our own, so that reset() replaces only our connections.
                self._fs = fsspec.filesystem("http", skip_instance_cache=True)
            return self._fs

    def _check_content_range(
        self, value: str | None, start: int, end: int, version: ObjectVersion
    ) -> None:
        parsed = _parse_content_range(value)
        if parsed is None:
            raise WeightsUnavailableError(self.url, f"malformed Content-Range {value!r}")
        first, last, total = parsed
        _check_total_size(self.url, total, version)
        if (first, last) != (start, end - 1):
            raise WeightsUnavailableError(
                self.url, f"asked for bytes {start}-{end - 1}, the server sent {first}-{last}"
            )

    def _check_whole_object(
        self, content_length: str | None, start: int, end: int, version: ObjectVersion
    ) -> None:
        # 200 instead of 206: the server ignored Range. Only usable when we asked for it all.
        if (start, end) != (0, version.size):
            raise WeightsUnavailableError(self.url, "the server does not support Range requests")
        if content_length is not None and content_length.isdigit():
            _check_total_size(self.url, int(content_length), version)


# ----------------------------------------------------------------------------------------------
# Local files


def _file_version(status: os.stat_result) -> ObjectVersion:
    return ObjectVersion(size=status.st_size, tag=f"{status.st_size}-{status.st_mtime_ns}")


def _pread_all(fd: int, start: int, end: int) -> RangeBytes:
    offset = start

    def readinto(view: memoryview) -> int:
        nonlocal offset
        count = os.preadv(fd, [view], offset)
        offset += count
        return count

    data, _ = read_into(end - start, readinto, probe=False)  # the version says its size
    return data


class FileOrigin(_CountedOrigin):
    """A local file (`file:///absolute/path`), read with pread. Its version is its size and
    modification time, re-checked around every read."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
            raise WeightsError(url, "a file URL names a local absolute path: file:///path")
        self.path = unquote(parts.path)

    def stat(self) -> ObjectVersion:
        self._count_stat()
        with self._file_errors():
            status = os.stat(self.path)
        if not stat_mode.S_ISREG(status.st_mode):
            raise WeightsNotFoundError(self.url, "not a regular file")
        return _file_version(status)

    def read_range(
        self,
        start: int,
        end: int,
        version: ObjectVersion,
        *,
        on_first_byte: FirstByte | None = None,
    ) -> RangeBytes:
        """A local read has no wait worth learning: `on_first_byte` is not called."""
        if start == end:
            return b""
        self._count_read()
        with self._file_errors():
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._check_version(fd, version)
                data = _pread_all(fd, start, end)
                # A rewrite in place during the read shows as a new modification time.
                self._check_version(fd, version)
            finally:
                os.close(fd)
        return self._deliver(data, start, end)

    def reset(self) -> None:
        """Nothing to drop: every read opens the file afresh."""

    def _check_version(self, fd: int, version: ObjectVersion) -> None:
        now = _file_version(os.fstat(fd))
        if now != version:
            raise _changed(self.url, f"size-mtime {now.tag}, not {version.tag}")

    @contextmanager
    def _file_errors(self) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, NotADirectoryError) as error:
            raise WeightsNotFoundError(self.url, "no such file") from error
        except IsADirectoryError as error:
            raise WeightsNotFoundError(self.url, "a directory, not a file") from error
        except PermissionError as error:
            raise WeightsAccessDeniedError(self.url, f"permission denied: {error}") from error
        except OSError as error:
            raise TransientOriginError(f"{type(error).__name__}: {error}") from error
