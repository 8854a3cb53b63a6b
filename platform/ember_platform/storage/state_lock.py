"""One control plane per state dir: a second `ember server` on the same state would
requeue and run again the first one's calls, and fire its schedules twice."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ember.errors import ConfigError

LOCK_FILE = "server.lock"


class StateDirLock:
    """An exclusive lock on the state dir, held while the process runs: the kernel lets it
    go when the process ends, however it ends."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"the state dir {self.path.parent} is in use by another ember server "
                f"(pid {holder}): stop it, or give this one its own --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
