"""Safe, atomic extraction of app bundles on the worker.

Bundles come from users, so every member is checked before anything is written:
no absolute paths, no `..`, no links, no special files, and hard caps on the number
of members and on the bytes written.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ember.errors import BundleError

_CHUNK = 1024 * 1024
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What a broken archive can raise from tarfile, gzip or zlib while being read.
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


def extract_bundle(
    data: bytes, dest: Path, *, max_bytes: int = 1024**3, max_files: int = 20_000
) -> Path:
    """Extract the gzip tar `data` into the new folder `dest` and return `dest`."""
    dest = Path(dest)
    if os.path.lexists(dest):
        raise BundleError(f"cannot extract bundle: '{dest}' already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.extract-", dir=dest.parent))
    try:
        _Extractor(tmp, max_bytes=max_bytes, max_files=max_files).run(data)
        os.chmod(tmp, 0o755)  # mkdtemp creates it 0o700
        try:
            os.replace(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            # Another process extracted the same bundle first; theirs is as good.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


@contextmanager
def _archive_errors() -> Iterator[None]:
    try:
        yield
    except _ARCHIVE_ERRORS as exc:
        raise BundleError(f"bundle is not a valid gzip tar archive: {exc}") from exc


class _Extractor:
    def __init__(self, root: Path, *, max_bytes: int, max_files: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.members = 0
        self.declared = 0
        self.written = 0
        self.names: set[tuple[str, ...]] = set()
        self.files: set[tuple[str, ...]] = set()
        self.dirs: set[tuple[str, ...]] = set()

    def run(self, data: bytes) -> None:
        with _archive_errors(), tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                self._extract(tar, member)

    def _extract(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.members += 1
        if self.members > self.max_files:
            raise BundleError(f"bundle has more than {self.max_files} members")
        parts = self._check(member)
        if not parts:
            return  # the archive's own root folder, "./"
        if member.isdir():
            self._make_dirs(member.name, parts)
            return
        self.declared += member.size
        if self.declared > self.max_bytes:
            raise BundleError(
                f"bundle member '{member.name}' takes the bundle over {self.max_bytes} bytes"
            )
        self._make_dirs(member.name, parts[:-1])
        self.files.add(parts)
        self._write_file(tar, member, self.root.joinpath(*parts))

    def _check(self, member: tarfile.TarInfo) -> tuple[str, ...]:
        """Validate one member and return its normalised path parts."""
        name = member.name
        if "\x00" in name:
            raise BundleError(f"bundle member {name!r} has a NUL byte in its name")
        if name.startswith("/"):
            raise BundleError(f"bundle member '{name}' is an absolute path")
        parts = tuple(p for p in name.split("/") if p not in ("", "."))
        if ".." in parts:
            raise BundleError(f"bundle member '{name}' escapes the bundle folder")
        target = os.path.normpath(os.path.join(self.root, *parts))
        if parts and not target.startswith(str(self.root) + os.sep):
            raise BundleError(f"bundle member '{name}' escapes the bundle folder")

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
        if not parts and not member.isdir():
            raise BundleError(f"bundle member '{name}' has an empty path")

        if parts in self.names:
            raise BundleError(f"bundle member '{name}' appears more than once")
        self.names.add(parts)
        for i in range(1, len(parts)):
            if parts[:i] in self.files:
                raise BundleError(
                    f"bundle member '{name}' is inside '{'/'.join(parts[:i])}', which is a file"
                )
        if member.isreg() and parts in self.dirs:
            raise BundleError(f"bundle member '{name}' is a file but also a folder")
        return parts

    def _make_dirs(self, name: str, parts: tuple[str, ...]) -> None:
        for i in range(1, len(parts) + 1):
            prefix = parts[:i]
            if prefix in self.dirs:
                continue
            path = self.root.joinpath(*prefix)
            try:
                os.mkdir(path, 0o755)
                os.chmod(path, 0o755)  # mkdir's mode is filtered by the umask
            except OSError as exc:
                raise BundleError(
                    f"cannot create folder for bundle member '{name}': {exc.strerror}"
                ) from exc
            self.dirs.add(prefix)

    def _write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> None:
        mode = 0o755 if member.mode & 0o100 else 0o644
        try:
            fd = os.open(path, _OPEN_FLAGS, mode)
        except OSError as exc:
            raise BundleError(
                f"cannot create bundle member '{member.name}': {exc.strerror}"
            ) from exc
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)  # os.open's mode is filtered by the umask
            source = tar.extractfile(member)
            if source is None:  # only for non-files, which _check already refused
                raise BundleError(f"bundle member '{member.name}' has no data")
            with source:
                while True:
                    with _archive_errors():
                        chunk = source.read(_CHUNK)
                    if not chunk:
                        break
                    self.written += len(chunk)
                    if self.written > self.max_bytes:
                        raise BundleError(
                            f"bundle member '{member.name}' takes the bundle over "
                            f"{self.max_bytes} bytes"
                        )
                    out.write(chunk)
