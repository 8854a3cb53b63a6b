"""What an app bundle may hold, checked alike by the control plane at upload and by the
worker as it extracts: regular files and folders at relative paths inside the bundle
(no absolute path, no `..`, no links, devices, FIFOs or sparse files, no name twice),
at most MAX_FILES members and MAX_EXPANDED_BYTES of file data. A manifest's entry file
must be a relative `.py` path inside the bundle too.

Bundles come from users, so the archive is read as a stream: every member's real data
is counted as it is read, and so is the whole decompressed stream (tar headers, PAX
records), so that no archive makes a reader hold or write more than the caps.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ember.errors import BundleError, BundleTooLargeError, InvalidError

MIB = 1024 * 1024
MAX_FILES = 20_000  # members, folders included
# File data once extracted: what `ember deploy` packs at most (ember.bundle), so that a
# bundle the CLI builds always passes.
MAX_EXPANDED_BYTES = 256 * MIB
# The decompressed stream holds headers too: a generous allowance per member on top of
# the data (a header block, a PAX record, padding), for long names and metadata.
STREAM_BYTES_PER_MEMBER = 16 * 1024
CHUNK = MIB
# What a broken archive can raise from tarfile, gzip or zlib while being read.
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


@dataclass(frozen=True)
class BundleSummary:
    files: int  # regular files
    size: int  # bytes of file data


@contextmanager
def archive_errors() -> Iterator[None]:
    """A broken archive (truncated, not gzip, a bad header) as a BundleError."""
    try:
        yield
    except _ARCHIVE_ERRORS as exc:
        raise BundleError(f"bundle is not a valid gzip tar archive: {exc}") from exc


class _CappedStream(io.RawIOBase):
    """The decompressed archive, refusing to give more than `limit` bytes."""

    def __init__(self, source: gzip.GzipFile, limit: int, max_bytes: int) -> None:
        self.source = source
        self.limit = limit
        self.max_bytes = max_bytes
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.source.read(len(buffer))
        self.read_bytes += len(data)
        if self.read_bytes > self.limit:
            raise BundleTooLargeError(
                f"bundle expands to more than {self.max_bytes} bytes (its archive alone "
                f"passes {self.limit} bytes once decompressed)"
            )
        buffer[: len(data)] = data
        return len(data)


class BundleRules:
    """The rules, applied member by member in archive order (state: names seen, counts)."""

    def __init__(self, *, max_bytes: int = MAX_EXPANDED_BYTES, max_files: int = MAX_FILES):
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.members = 0
        self.files = 0
        self.declared = 0  # file sizes as their headers say
        self.read = 0  # file data actually read
        self._names: set[tuple[str, ...]] = set()
        self._files: set[tuple[str, ...]] = set()
        self._dirs: set[tuple[str, ...]] = set()  # named or implied by a member's path

    def check(self, member: tarfile.TarInfo) -> tuple[str, ...]:
        """Validate one member and return its normalised path parts (empty for the
        archive's own root folder, "./")."""
        self.members += 1
        if self.members > self.max_files:
            raise BundleError(f"bundle has more than {self.max_files} members (at '{member.name}')")
        name = member.name
        parts = member_parts(name)
        if member.issym() or member.islnk():
            kind = "symbolic" if member.issym() else "hard"
            raise BundleError(
                f"bundle member '{name}' is a {kind} link to '{member.linkname}'; "
                "bundles may not contain links"
            )
        if member.ischr() or member.isblk():
            raise BundleError(f"bundle member '{name}' is a device file")
        if member.isfifo():
            raise BundleError(f"bundle member '{name}' is a FIFO")
        if member.issparse():
            raise BundleError(f"bundle member '{name}' is a sparse file, which is not supported")
        if not (member.isreg() or member.isdir()):
            raise BundleError(f"bundle member '{name}' has unsupported type {member.type!r}")
        if not parts:
            if not member.isdir():
                raise BundleError(f"bundle member '{name}' has an empty path")
            return parts
        if parts in self._names:
            raise BundleError(f"bundle member '{name}' appears more than once")
        self._names.add(parts)
        for i in range(1, len(parts)):
            if parts[:i] in self._files:
                raise BundleError(
                    f"bundle member '{name}' is inside '{'/'.join(parts[:i])}', which is a file"
                )
        if member.isdir():
            self._dirs.update(parts[:i] for i in range(1, len(parts) + 1))
            return parts
        if parts in self._dirs:
            raise BundleError(f"bundle member '{name}' is a file but also a folder")
        self._dirs.update(parts[:i] for i in range(1, len(parts)))
        self._files.add(parts)
        self.files += 1
        self.declared += member.size
        if self.declared > self.max_bytes:
            raise BundleTooLargeError(
                f"bundle member '{name}' takes the bundle over {self.max_bytes} bytes"
            )
        return parts

    def count(self, name: str, size: int) -> None:
        """Count `size` bytes of member `name`'s data, as read."""
        self.read += size
        if self.read > self.max_bytes:
            raise BundleTooLargeError(
                f"bundle member '{name}' takes the bundle over {self.max_bytes} bytes"
            )


def member_parts(name: str) -> tuple[str, ...]:
    """A member name's path parts, or a BundleError where it points outside the bundle."""
    if "\x00" in name:
        raise BundleError(f"bundle member {name!r} has a NUL byte in its name")
    if name.startswith("/"):
        raise BundleError(f"bundle member '{name}' is an absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise BundleError(f"bundle member '{name}' escapes the bundle folder")
    return parts


@contextmanager
def open_bundle(data: bytes, rules: BundleRules) -> Iterator[tarfile.TarFile]:
    """The gzip tar `data` as a tarfile read in stream mode (members in order, each
    member's data only while it is the current one), its decompressed size capped."""
    limit = rules.max_bytes + rules.max_files * STREAM_BYTES_PER_MEMBER
    with (
        archive_errors(),
        gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb") as unzipped,
        io.BufferedReader(_CappedStream(unzipped, limit, rules.max_bytes), CHUNK) as stream,
        tarfile.open(fileobj=stream, mode="r|") as tar,
    ):
        yield tar


def read_data(tar: tarfile.TarFile, member: tarfile.TarInfo, rules: BundleRules) -> Iterator[bytes]:
    """The data of the current file member, in chunks, each counted against the cap."""
    source = tar.extractfile(member)
    if source is None:  # only for non-files, which the rules refuse
        raise BundleError(f"bundle member '{member.name}' has no data")
    with source:
        while True:
            with archive_errors():
                chunk = source.read(CHUNK)
            if not chunk:
                return
            rules.count(member.name, len(chunk))
            yield chunk


def check_bundle(
    data: bytes, *, max_bytes: int = MAX_EXPANDED_BYTES, max_files: int = MAX_FILES
) -> BundleSummary:
    """Read the whole bundle, writing nothing, and raise BundleError naming the first
    member that breaks a rule (BundleTooLargeError for one past the size cap)."""
    rules = BundleRules(max_bytes=max_bytes, max_files=max_files)
    with open_bundle(data, rules) as tar:
        for member in tar:
            rules.check(member)
            if member.isreg():
                for _chunk in read_data(tar, member, rules):
                    pass
    return BundleSummary(files=rules.files, size=rules.read)


def check_entry(entry: object) -> str:
    """A manifest's entry file: a relative POSIX path inside the bundle, of a `.py` file."""
    if not isinstance(entry, str) or not entry:
        raise InvalidError("the manifest's entry must be the path of a .py file in the bundle")
    if "\x00" in entry or "\\" in entry:
        raise InvalidError(f"entry {entry!r} may not hold a NUL byte or a backslash")
    path = PurePosixPath(entry)
    if path.is_absolute() or ".." in path.parts:
        raise InvalidError(f"entry '{entry}' must be a relative path inside the bundle")
    if path.suffix != ".py" or path.name == ".py":
        raise InvalidError(f"entry '{entry}' must be a .py file")
    return entry


def entry_path(bundle_dir: Path, entry: str) -> Path:
    """The entry file in `bundle_dir`, refused (InvalidError) where it is outside it,
    links followed."""
    check_entry(entry)
    root = bundle_dir.resolve()
    path = (root / entry).resolve()
    if not path.is_relative_to(root):
        raise InvalidError(f"entry '{entry}' resolves outside the bundle folder")
    return path
