"""Client-side app bundles: a deterministic gzip tar of an app folder."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ember.errors import BundleError
from ember.ignore_rules import Rule, ignored, load_rules

# Caches, environments and VCS data that never belong in a deployed app.
EXCLUDED_NAMES = frozenset(
    {
        ".git",
        "__pycache__",
        ".venv",
        "venv",
        "node_modules",
        ".ember",
        ".pytest_cache",
        ".ruff_cache",
        ".mypy_cache",
    }
)
EXCLUDED_SUFFIXES = (".pyc",)

# Level 6 is zlib's default trade-off; 9 is much slower for little gain on code.
_COMPRESS_LEVEL = 6


@dataclass(frozen=True)
class Bundle:
    data: bytes
    digest: str  # "sha256:<hex>" of data
    file_count: int
    size: int  # uncompressed bytes
    files: frozenset[str] = frozenset()  # the paths in it, relative to the app folder


@dataclass(frozen=True)
class _Entry:
    arcname: str
    source: Path  # the regular file to read (a link's target when dereferenced)


def build_bundle(
    app_dir: Path, *, max_bytes: int = 256 * 1024**2, max_files: int = 10_000
) -> Bundle:
    """Pack every regular file under `app_dir` into a reproducible gzip tar."""
    app_dir = Path(app_dir)
    if not app_dir.is_dir():
        raise BundleError(
            f"app folder '{app_dir}' does not exist or is not a folder; "
            "pass the folder that holds your app's code"
        )
    root = app_dir.resolve()

    entries: list[_Entry] = []
    total = 0
    for entry in _walk(root, root, load_rules(root)):
        entries.append(entry)
        if len(entries) > max_files:
            raise BundleError(
                f"app folder '{app_dir}' has more than {max_files} files; "
                "remove files the app does not need, or keep data sets and model "
                "weights outside the app folder and load them at startup"
            )
        try:
            total += entry.source.stat().st_size
        except OSError as exc:
            raise BundleError(f"cannot read '{entry.source}': {exc.strerror}") from exc
        _check_size(app_dir, total, max_bytes)
    entries.sort(key=lambda e: e.arcname)

    buf = io.BytesIO()
    written = 0
    # GzipFile with mtime=0 and no file name keeps the gzip header reproducible.
    with (
        gzip.GzipFile(
            filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=_COMPRESS_LEVEL
        ) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar,
    ):
        for entry in entries:
            written += _add_file(tar, entry)
            # Files may grow between the scan and the read; recheck on real sizes.
            _check_size(app_dir, written, max_bytes)

    data = buf.getvalue()
    return Bundle(
        data=data,
        digest="sha256:" + hashlib.sha256(data).hexdigest(),
        file_count=len(entries),
        size=written,
        files=frozenset(entry.arcname for entry in entries),
    )


def bundled_files(app_dir: Path) -> Iterator[tuple[str, Path]]:
    """The files a bundle of `app_dir` holds, as (path in the bundle, file read): what
    `ember serve` watches, so that it redeploys for these and nothing else."""
    root = Path(app_dir).resolve()
    for entry in _walk(root, root, load_rules(root)):
        yield entry.arcname, entry.source


def _check_size(app_dir: Path, total: int, max_bytes: int) -> None:
    if total > max_bytes:
        raise BundleError(
            f"app folder '{app_dir}' holds more than {max_bytes} bytes of files; "
            "remove files the app does not need, or keep data sets and model "
            "weights outside the app folder and load them at startup"
        )


def _walk(root: Path, folder: Path, rules: list[Rule]) -> Iterator[_Entry]:
    try:
        children = sorted(os.scandir(folder), key=lambda d: d.name)
    except OSError as exc:
        raise BundleError(f"cannot read folder '{folder}': {exc.strerror}") from exc
    for child in children:
        if child.name in EXCLUDED_NAMES or child.name.endswith(EXCLUDED_SUFFIXES):
            continue
        path = Path(child.path)
        relative = path.relative_to(root).as_posix()
        if rules and ignored(rules, relative, child.is_dir(follow_symlinks=False)):
            continue
        if child.is_symlink():
            target = _link_target(root, path)
            if target is not None:
                yield _Entry(path.relative_to(root).as_posix(), target)
        elif child.is_dir(follow_symlinks=False):
            yield from _walk(root, path, rules)
        elif child.is_file(follow_symlinks=False):
            yield _Entry(path.relative_to(root).as_posix(), path)
        # Sockets, FIFOs and devices cannot be shipped; skip them.


def _link_target(root: Path, link: Path) -> Path | None:
    """The regular file a link points to, or None when it is unsafe or unusable."""
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):
        return None  # dangling or a loop
    if not target.is_relative_to(root):
        return None  # never ship files from outside the app folder
    # Linked folders are skipped: their files are bundled under their real path,
    # and following them could loop.
    return target if target.is_file() else None


def _add_file(tar: tarfile.TarFile, entry: _Entry) -> int:
    try:
        with entry.source.open("rb") as f:
            st = os.fstat(f.fileno())
            info = tarfile.TarInfo(entry.arcname)
            info.size = st.st_size
            info.mtime = 0
            info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, f)
    except OSError as exc:
        # tarfile raises OSError too when a file shrank while being read.
        raise BundleError(
            f"cannot add '{entry.arcname}' to the bundle: {exc}; "
            "make sure no other program is changing the app folder"
        ) from exc
    return info.size
