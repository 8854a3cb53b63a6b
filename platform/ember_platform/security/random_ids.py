"""Random bytes for the ids every call gets (its call id, its trace and span ids), taken
from a pool the kernel fills 4 KiB at a time.

One `getrandom` system call per id cost the gateway as much as any other step of a call
(bench/gateway.py's profile); the bytes are the kernel's all the same, only fetched in
bulk. A forked child starts with an empty pool, so no two processes hand out the same
bytes. Not for keys kept long (tokens, secrets): those take `secrets` directly.
"""

from __future__ import annotations

import base64
import os
import threading

POOL_BYTES = 4096


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # two threads never take the same bytes
        self._bytes = b""
        self._at = 0

    def take(self, count: int) -> bytes:
        with self._lock:
            if self._at + count > len(self._bytes):
                self._bytes, self._at = os.urandom(max(POOL_BYTES, count)), 0
            start = self._at
            self._at += count
            return self._bytes[start : self._at]

    def empty(self) -> None:
        self._bytes, self._at = b"", 0


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.empty)


def random_bytes(count: int) -> bytes:
    """`count` bytes from the kernel's random source, none ever handed out twice."""
    return _pool.take(count)


def random_token(count: int) -> str:
    """`count` random bytes as URL-safe text, as `secrets.token_urlsafe(count)` makes it."""
    return base64.urlsafe_b64encode(random_bytes(count)).rstrip(b"=").decode("ascii")
