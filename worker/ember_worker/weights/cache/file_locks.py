"""Byte-range locks on a file that hold across threads and processes alike.

Open file description (OFD) locks: owned by the open file, not by the process as classic
`lockf`/`fcntl` record locks are, so two threads of one process that opened the file
separately exclude each other too, and closing some other descriptor of the file does not
drop them. The kernel releases them when the holder's descriptor closes or it dies, so a
crashed holder never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import struct

# Linux's values, for a Python built without the names.
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
# struct flock: l_type, l_whence, l_start, l_len, l_pid (0, as OFD locks require).
_FLOCK = "hhqqi4x"  # padded to the kernel's 32 bytes


def _flock(kind: int, start: int, length: int) -> bytes:
    return struct.pack(_FLOCK, kind, 0, start, length, 0)


def lock_range(descriptor: int, start: int, length: int) -> None:
    """Wait for an exclusive lock on bytes [start, start + length); length 0: to the end."""
    fcntl.fcntl(descriptor, _F_OFD_SETLKW, _flock(fcntl.F_WRLCK, start, length))


def try_lock_range(descriptor: int, start: int, length: int) -> bool:
    """Take the exclusive lock if nobody holds any part of the range; False if somebody does."""
    try:
        fcntl.fcntl(descriptor, _F_OFD_SETLK, _flock(fcntl.F_WRLCK, start, length))
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES, as the kernel chooses
        return False
    return True
