"""Safe, atomic extraction of app bundles on the worker.

Bundles come from users, so every member is checked before anything is written, with
the rules the control plane applied at upload (ember.wire.bundle_rules): no absolute
paths, no `..`, no links, no special files, and hard caps on the number of members and
on the bytes written. What was written is listed (path, size, sha256), for the check
before each start (bundles.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from ember.errors import BundleError
from ember.wire.bundle_rules import (
    MAX_EXPANDED_BYTES,
    MAX_FILES,
    BundleRules,
    open_bundle,
    read_data,
)

_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# Relative POSIX path -> (size, sha256 hex) of every file extracted.
Listing = dict[str, tuple[int, str]]


def extract_bundle(
    data: bytes, dest: Path, *, max_bytes: int = MAX_EXPANDED_BYTES, max_files: int = MAX_FILES
) -> Path:
    """Extract the gzip tar `data` into the new folder `dest` and return `dest`."""
    return extract_listed(data, dest, max_bytes=max_bytes, max_files=max_files)[0]


def extract_listed(
    data: bytes, dest: Path, *, max_bytes: int = MAX_EXPANDED_BYTES, max_files: int = MAX_FILES
) -> tuple[Path, Listing]:
    """extract_bundle, also returning what it wrote: each file's size and sha256."""
    dest = Path(dest)
    if os.path.lexists(dest):
        raise BundleError(f"cannot extract bundle: '{dest}' already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.extract-", dir=dest.parent))
    try:
        extractor = _Extractor(tmp, BundleRules(max_bytes=max_bytes, max_files=max_files))
        extractor.run(data)
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
    return dest, extractor.listing


class _Extractor:
    def __init__(self, root: Path, rules: BundleRules) -> None:
        self.root = root
        self.rules = rules
        self.dirs: set[tuple[str, ...]] = set()
        self.listing: Listing = {}

    def run(self, data: bytes) -> None:
        with open_bundle(data, self.rules) as tar:
            for member in tar:
                parts = self.rules.check(member)
                if not parts:
                    continue  # the archive's own root folder, "./"
                if member.isdir():
                    self._make_dirs(member.name, parts)
                    continue
                self._make_dirs(member.name, parts[:-1])
                self._write_file(tar, member, parts)

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

    def _write_file(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: tuple[str, ...]
    ) -> None:
        mode = 0o755 if member.mode & 0o100 else 0o644
        try:
            fd = os.open(self.root.joinpath(*parts), _OPEN_FLAGS, mode)
        except OSError as exc:
            raise BundleError(
                f"cannot create bundle member '{member.name}': {exc.strerror}"
            ) from exc
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)  # os.open's mode is filtered by the umask
            for chunk in read_data(tar, member, self.rules):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        self.listing["/".join(parts)] = (size, digest.hexdigest())
