"""Secrets the control plane keeps in its state dir as files only its user may read: the
admin token (so restarts can rewrite the client config) and the webhook secret."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def kept_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret in `path`; the first time, `make()`'s, written there with mode 0600
    (created exclusively, never readable by others even for a moment)."""
    if path.exists():
        return path.read_text().strip()
    secret = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")
    return secret


def replace_secret(path: Path, secret: str) -> None:
    """Put `secret` in `path` in place of what it held, as `kept_secret` writes one: the
    new file is whole and 0600 from the start, then renamed over the old."""
    fresh = path.with_name(path.name + ".new")
    fresh.unlink(missing_ok=True)
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")
    os.replace(fresh, path)
