"""The agent's work, as root, in trees a tenant writes (working areas, volume copies,
what a replica's sandbox shows of them), never following a link the tenant planted.

A replica may swap any folder of such a tree for a link at any moment (its snapshot phase
may even run as uid 0, owning the tree's top). A path resolved by name there may lead
anywhere on the node, so each one is walked a component at a time from a folder's
descriptor, every step O_NOFOLLOW (a link ends the walk with ELOOP or ENOTDIR), and
owners are changed on the entry itself (lchown at a folder's descriptor).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path, PurePosixPath

_FOLDER = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WALKED = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # a folder whose entries are listed


def open_beneath(top: str | Path, relative: str | PurePosixPath, flags: int = os.O_RDONLY) -> int:
    """A descriptor of `relative` under the folder `top`, opened with `flags`, no
    component of `relative` followed if it is a link (OSError: ELOOP or ENOTDIR then).
    `top` itself is trusted (opened as named: /proc/<pid>/root is such a link)."""
    parts = [p for p in PurePosixPath(relative).parts if p != "/"]
    if not parts or any(p in (".", "..") for p in parts):
        raise OSError(f"{relative!r} is not a path beneath a folder")
    folder = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, _FOLDER, dir_fd=folder)
            os.close(folder)
            folder = inner
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    finally:
        os.close(folder)


def open_regular(top: str | Path, relative: str | PurePosixPath) -> int:
    """A read-only descriptor of the regular file `relative` under `top` (open_beneath);
    OSError if it is anything else. Nothing else is ever opened for reading: a device
    node's open may act (a watchdog's starts its timer), a FIFO's would block."""
    path_fd = open_beneath(top, relative, os.O_PATH)
    try:
        if not stat.S_ISREG(os.fstat(path_fd).st_mode):
            raise OSError(f"{relative} is not a regular file")
        # The very file found, not a name that could be swapped again meanwhile.
        return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(path_fd)


def chown_tree(top: str | Path, uid: int, gid: int) -> None:
    """Give the folder `top` and everything in it to uid:gid: links themselves, never
    what they point at. Folders are entered by descriptor, O_NOFOLLOW (one swapped for a
    link meanwhile is not entered; nothing but folders is ever opened) and handed over
    through that descriptor once their content is, bottom up: a uid 0 without
    CAP_DAC_OVERRIDE (a replica's snapshot phase, boot.py) could not enter a 0700 folder
    it gave away. One descriptor per level is open at a time."""
    first = os.open(top, _WALKED | os.O_NOFOLLOW)
    stack = [(first, _chown_entries(first, uid, gid))]
    try:
        while stack:
            folder, subfolders = stack[-1]
            if not subfolders:
                stack.pop()
                try:
                    os.fchown(folder, uid, gid)
                finally:
                    os.close(folder)
                continue
            try:  # gone, or no longer a folder: not entered
                inner = os.open(subfolders.pop(), _WALKED | os.O_NOFOLLOW, dir_fd=folder)
            except OSError:
                continue
            stack.append((inner, _chown_entries(inner, uid, gid)))
    finally:
        for folder, _ in stack:
            os.close(folder)


def _chown_entries(folder: int, uid: int, gid: int) -> list[str]:
    """lchown what `folder` holds but folders; the names of those."""
    with os.scandir(folder) as entries:
        found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_folder in found:
        if not is_folder:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                os.chown(name, uid, gid, dir_fd=folder, follow_symlinks=False)
    return [name for name, is_folder in found if is_folder]
