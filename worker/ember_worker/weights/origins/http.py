"""Objects on an HTTP(S) server, through fsspec's HTTP filesystem (aiohttp, imported on
first use): one ranged GET per range, its headers checked against the object's version."""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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
from ember_worker.weights.origins.range_buffers import RangeBytes, allocate


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
        return changed_at_origin(url, f"HTTP {status}")
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


class FsspecOrigin(CountedOrigin):
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
            raise changed_at_origin(self.url, f"version {response.tag}, not {version.tag}")
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

    def prepare(self) -> None:
        """Import fsspec and aiohttp and make the filesystem now, contacting no one."""
        self._filesystem()

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
        parsed = parse_content_range(value)
        if parsed is None:
            raise WeightsUnavailableError(self.url, f"malformed Content-Range {value!r}")
        first, last, total = parsed
        check_total_size(self.url, total, version)
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
            check_total_size(self.url, int(content_length), version)
