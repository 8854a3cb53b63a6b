"""Local files (`file:///absolute/path`), read with pread; a file's version is its size
and modification time."""

from __future__ import annotations

import os
import stat as stat_mode
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit

from ember.errors import WeightsAccessDeniedError, WeightsError, WeightsNotFoundError
from ember_worker.weights.origins.origin import (
    CountedOrigin,
    FirstByte,
    ObjectVersion,
    TransientOriginError,
    changed_at_origin,
)
from ember_worker.weights.origins.range_buffers import RangeBytes, read_into


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


class FileOrigin(CountedOrigin):
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
            raise changed_at_origin(self.url, f"size-mtime {now.tag}, not {version.tag}")

    @contextmanager
    def _file_errors(self) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, NotADirectoryError) as error:
            raise WeightsNotFoundError(
                self.url,
                "no such file (a sandboxed replica sees only the node's folders its worker "
                "shows it: `ember worker --model-dir`)",
            ) from error
        except IsADirectoryError as error:
            raise WeightsNotFoundError(self.url, "a directory, not a file") from error
        except PermissionError as error:
            raise WeightsAccessDeniedError(self.url, f"permission denied: {error}") from error
        except OSError as error:
            raise TransientOriginError(f"{type(error).__name__}: {error}") from error
