"""Memory for the bytes of a fetched range, and how a body is read into it.

A range of a megabyte or more goes into an anonymous mapping of its own, not malloc's
heap. glibc serves a 16 MiB request from the arena of the thread that asks once it has
freed one such block (its mmap threshold rises to match), and keeps what is freed on top
of a thread's arena for good (`malloc_trim` does not shrink those): a replica whose
`enter(snap=True)` read its weights cold kept ~10 MiB per fetching thread, and its
snapshot image carried them. A mapping goes back to the kernel when its last reference
does.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

OWN_MAPPING_BYTES = 1 << 20

# What an origin hands over: bytes for small or empty ranges, else a buffer of its own.
RangeBytes = bytes | bytearray | mmap.mmap


def allocate(size: int) -> bytearray | mmap.mmap:
    """A zeroed, writable buffer of `size` bytes (a mapping of its own from 1 MiB, its
    pages made present at once: one call, not a fault per page as it fills)."""
    if size >= OWN_MAPPING_BYTES:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        return mmap.mmap(-1, size, flags=flags)
    return bytearray(size)


def read_into(
    size: int, readinto: Callable[[memoryview], int], *, probe: bool = True
) -> tuple[RangeBytes, bool]:
    """Fill a buffer of `size` bytes with `readinto(view)` calls (0: the end of the body);
    the bytes read (shortened by a copy when the body ended early) and whether the body
    had more than `size` (with `probe`, one byte past it is read to know)."""
    buffer = allocate(size)
    done = 0
    with memoryview(buffer) as view:
        while done < size:
            count = readinto(view[done:])
            if not count:
                break
            done += count
        longer = probe and done == size and readinto(memoryview(bytearray(1))) > 0
        if done < size:
            return bytes(view[:done]), False
    return buffer, longer
