"""The contents of local files and folders an image copies in (`add_local_file`,
`add_local_dir`), hashed when the step is declared: the layer's digest changes exactly
when what it would copy does."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from ember.errors import InvalidError

MAX_FILES = 100_000
MAX_BYTES = 4 * 1024**3


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def entry_line(relative: str, info: os.stat_result, path: Path) -> str:
    """One entry of a tree's listing: its path, kind, executable bit and contents."""
    if stat.S_ISLNK(info.st_mode):
        return f"l {relative} {os.readlink(path)}"
    if stat.S_ISDIR(info.st_mode):
        return f"d {relative}"
    if stat.S_ISREG(info.st_mode):
        executable = "x" if info.st_mode & 0o111 else "-"
        return f"f {relative} {executable} {file_sha256(path)}"
    raise InvalidError(
        f"{path}: only files, folders and symbolic links can be copied into an image"
    )


def tree_digest(local: str | os.PathLike[str]) -> tuple[str, int]:
    """(sha256 of the folder's listing and contents, number of entries)."""
    root = Path(local)
    if not root.is_dir():
        raise InvalidError(f"add_local_dir: {str(local)!r} is not a folder")
    lines: list[str] = []
    total = 0
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(folder) / name
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
            lines.append(entry_line(path.relative_to(root).as_posix(), info, path))
            if len(lines) > MAX_FILES or total > MAX_BYTES:
                raise InvalidError(
                    f"add_local_dir: {str(local)!r} holds more than {MAX_FILES} entries or "
                    f"{MAX_BYTES // 1024**3} GiB; copy less, or install it in a run_commands step"
                )
    return hashlib.sha256("\n".join(lines).encode()).hexdigest(), len(lines)


def one_file_digest(local: str | os.PathLike[str]) -> str:
    path = Path(local)
    if not path.is_file():
        raise InvalidError(f"add_local_file: {str(local)!r} is not a file")
    info = path.stat()
    if info.st_size > MAX_BYTES:
        raise InvalidError(f"add_local_file: {str(local)!r} is over {MAX_BYTES // 1024**3} GiB")
    return entry_line(path.name, info, path).split(" ", 2)[2]
