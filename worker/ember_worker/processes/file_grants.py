"""Access for one replica user to a path the agent owns, through a POSIX ACL entry.

Replicas run as a uid of their workspace (replica_users.py), while their bundle, their
app's Python environment and the folders above them belong to root. Rather than opening
such a folder to every user (mode bits), the agent adds a named-user entry for the one
uid that needs it (`user:200123:r-x`), the kernel's `system.posix_acl_access` attribute
in its binary form (what `setfacl` writes). `private=True` also takes the owning group's
and others' rights away, so that the folder is reachable by root and the named users
alone: its files inside may keep mode 0644, since no one else can pass the folder.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

ACL_ATTRIBUTE = "system.posix_acl_access"
_VERSION = 2
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
READ, WRITE, EXECUTE = 4, 2, 1
RX = READ | EXECUTE
RWX = READ | WRITE | EXECUTE

Entry = tuple[int, int, int]  # tag, permissions, id


def _from_mode(mode: int) -> list[Entry]:
    return [
        (USER_OBJ, (mode >> 6) & 7, _NO_ID),
        (GROUP_OBJ, (mode >> 3) & 7, _NO_ID),
        (OTHER, mode & 7, _NO_ID),
    ]


def read_acl(path: Path) -> list[Entry]:
    """The path's access ACL; the three entries its mode bits stand for where it has none."""
    try:
        data = os.getxattr(path, ACL_ATTRIBUTE, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
        return _from_mode(os.lstat(path).st_mode)
    (version,) = _HEADER.unpack_from(data)
    if version != _VERSION or (len(data) - _HEADER.size) % _ENTRY.size:
        raise OSError(errno.EINVAL, f"an ACL of an unknown form on {path}")
    return [
        _ENTRY.unpack_from(data, offset) for offset in range(_HEADER.size, len(data), _ENTRY.size)
    ]


def _write_acl(path: Path, entries: list[Entry]) -> None:
    named = [e for e in entries if e[0] in (USER, GROUP)]
    if named:  # the mask bounds named entries and the owning group: it must cover them
        group = [e[1] for e in entries if e[0] == GROUP_OBJ]
        mask = 0
        for permissions in [*group, *(e[1] for e in named)]:
            mask |= permissions
        entries = [e for e in entries if e[0] != MASK] + [(MASK, mask, _NO_ID)]
    entries.sort(key=lambda e: (e[0], e[2]))
    data = _HEADER.pack(_VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)
    os.setxattr(path, ACL_ATTRIBUTE, data, follow_symlinks=False)


def grant(path: Path, uid: int, permissions: int, *, private: bool = False) -> None:
    """Give `uid` these rights on `path` (kept beside what it had); with `private`, the
    owning group and others lose theirs. OSError where the file system keeps no ACLs."""
    entries = read_acl(path)
    had = next((e[1] for e in entries if e[0] == USER and e[2] == uid), 0)
    # A chmod since (the server's of its state dir) sets the mask from the group bits.
    mask = next((e[1] for e in entries if e[0] == MASK), 0)
    if (had & mask & permissions) == permissions and not (
        private and any(e[1] for e in entries if e[0] in (GROUP_OBJ, OTHER))
    ):
        return  # nothing to change: no write, so no change of its ctime either
    entries = [e for e in entries if not (e[0] == USER and e[2] == uid)]
    entries.append((USER, had | permissions, uid))
    if private:
        entries = [(t, 0, i) if t in (GROUP_OBJ, OTHER) else (t, p, i) for t, p, i in entries]
    _write_acl(path, entries)


def _others_may(path: Path, permissions: int) -> bool:
    return os.stat(path).st_mode & permissions == permissions  # "other" bits: the low three


def ancestors(path: Path) -> Iterator[Path]:
    """`path`'s folders from the root down, itself left out."""
    parts = path.absolute().parents
    yield from reversed(parts)


def grant_passage(path: Path, uid: int) -> None:
    """Let `uid` pass through every folder above `path` (search rights, not listing):
    only those that others may not pass already, and not its own, get an entry."""
    for folder in ancestors(path):
        if not _others_may(folder, EXECUTE) and os.stat(folder).st_uid != uid:
            grant(folder, uid, EXECUTE)


def reachable(path: Path, permissions: int) -> bool:
    """Whether any user may reach `path` and has these rights on it by its mode bits."""
    try:
        return all(_others_may(f, EXECUTE) for f in ancestors(path)) and _others_may(
            path, permissions
        )
    except OSError:
        return False
