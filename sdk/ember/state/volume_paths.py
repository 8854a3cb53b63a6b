"""What a file's path inside an `ember.Volume` may be: the SDK checks it before sending,
the control plane again before storing. And where a node keeps its volumes' copies, as
a replica is told (the worker names it without loading the SDK's HTTP client)."""

from __future__ import annotations

import os

from ember.errors import InvalidError

VOLUMES_DIR_ENV = "EMBER_VOLUMES_DIR"  # the node's folder of local copies, in a replica
MAX_PATH_BYTES = 1024
MAX_PART_BYTES = 255  # what one name in a Linux path may be


def path_text(path: str | os.PathLike[str]) -> str:
    """A path given as text or as a path object (`pathlib.PurePosixPath("a/b")`)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise InvalidError(f"a volume path is a string or a path, not {type(path).__name__}")
    return path.replace(os.sep, "/")


def check_volume_path(path: str | os.PathLike[str]) -> str:
    """`path` as stored: relative, "/"-separated, without "." or ".." parts, empty parts or
    control characters, so that it is one place in every replica's copy."""
    path = path_text(path)
    cleaned = path.strip("/")
    parts = cleaned.split("/")
    if (
        not cleaned
        or len(cleaned.encode()) > MAX_PATH_BYTES
        or any(part in ("", ".", "..") or len(part.encode()) > MAX_PART_BYTES for part in parts)
        or any(ord(char) < 32 or ord(char) == 127 for char in cleaned)
    ):
        raise InvalidError(
            f"volume path {path!r} is not allowed: use names joined by '/', without '.', "
            f"'..', empty names or control characters, up to {MAX_PATH_BYTES} bytes"
        )
    return cleaned


def check_volume_prefix(prefix: str | os.PathLike[str]) -> str:
    """A folder's path ("" for the whole volume), as `check_volume_path` allows."""
    text = path_text(prefix)
    return "" if text.strip("/") == "" else check_volume_path(text)


def parents(path: str) -> list[str]:
    """The folders above a path: "a/b/c" -> ["a", "a/b"]."""
    parts = path.split("/")
    return ["/".join(parts[:count]) for count in range(1, len(parts))]
