"""The node's copies of ember.Volume folders, kept within a disk budget.

The SDK keeps each copy as `<root>/<app>/<volume>/` beside `.<volume>.state.json` (what
it last had in common with the volume, rewritten at each reload and commit) and
`.<volume>.lock` (the `flock` that serializes the node's replicas). Copies of apps with
no replica on the node are removed, least recently synced first, while the copies take
more than the budget. A removal holds the copy's lock, so a replica that starts meanwhile
waits and then fetches the volume anew; the lock file itself stays, so that every process
locks the same file.

The agent runs a collection when it starts and after each replica's exit, one at a time
and at most every few seconds (VolumeCopyCollector). The copies are their workspace's to
write, the agent works on them as root: it follows no link in them (sizes and times by
lstat, folders walked by descriptor, the lock file opened O_NOFOLLOW in its folder).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger("ember.worker")

# Copies are walked at most this often: replicas with max_inputs=1 exit per input.
VOLUME_COLLECTION_SECONDS = 5.0


@dataclass(frozen=True)
class VolumeCopy:
    app: str
    volume: str
    folder: Path
    disk_bytes: int  # blocks in use, as du counts them (sparse files count what they hold)
    last_synced: float  # its state file's mtime: the last reload or commit on this node

    @property
    def state_file(self) -> Path:
        return self.folder.parent / f".{self.volume}.state.json"

    @property
    def lock_file(self) -> Path:
        return self.folder.parent / f".{self.volume}.lock"

    @property
    def incoming(self) -> Path:
        """Where a reload fetches files before they join the copy (left by one that
        crashed until the next clears it)."""
        return self.folder.parent / f".{self.volume}.incoming"


def disk_bytes(folder: Path) -> int:
    total = 0
    try:
        # Not `folder` itself if it is a link, nor a folder in it swapped for one.
        for _, _, names, folder_fd in os.fwalk(folder, follow_symlinks=False):
            for name in names:
                try:
                    total += os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue  # removed while counted
    except OSError:
        return total
    return total


def list_copies(root: Path) -> list[VolumeCopy]:
    copies = []
    for app_dir in _subfolders(root):
        for folder in _subfolders(app_dir):
            state = app_dir / f".{folder.name}.state.json"
            try:
                synced = state.lstat().st_mtime
            except OSError:
                synced = folder.lstat().st_mtime  # never synced to the end: as old as it is
            used = disk_bytes(folder) + disk_bytes(app_dir / f".{folder.name}.incoming")
            copies.append(VolumeCopy(app_dir.name, folder.name, folder, used, synced))
    return copies


def _subfolders(folder: Path) -> list[Path]:
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if p.is_dir() and not p.is_symlink() and p.name[:1] != ".")


def remove_copy(copy: VolumeCopy, busy: Callable[[str], bool]) -> bool:
    """Remove one copy under its lock; False if a replica holds the lock, or if its app
    has a replica on the node by the time the lock is held (asked then, so that a replica
    started meanwhile keeps its copy)."""
    with _open_lock(copy) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if busy(copy.app):
            return False
        # The state goes first: should the removal stop halfway, the next replica finds
        # no record and compares every file left by its content.
        copy.state_file.unlink(missing_ok=True)
        shutil.rmtree(copy.folder, ignore_errors=True)
        shutil.rmtree(copy.incoming, ignore_errors=True)
    return True


def _open_lock(copy: VolumeCopy) -> IO[bytes]:
    """The copy's lock file, made if missing (as its folder's owner, who locks it too),
    never through a link: the folder is its workspace's to write (OSError otherwise)."""
    app_dir = os.open(copy.folder.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(copy.lock_file.name, flags, 0o600, dir_fd=app_dir)
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(f"{copy.lock_file} is not a regular file")
            if status.st_uid == 0:  # the agent's own new file: the replicas' lock as well
                owner = os.fstat(app_dir)
                os.fchown(fd, owner.st_uid, owner.st_gid)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "r+b")
    finally:
        os.close(app_dir)


def collect_garbage(root: Path, budget_bytes: int, busy: Callable[[str], bool]) -> list[VolumeCopy]:
    """Remove copies of apps for which `busy` is False, least recently synced first,
    until all copies fit `budget_bytes` (or only busy ones are left); the copies removed."""
    copies = list_copies(root)
    total = sum(copy.disk_bytes for copy in copies)
    removed = []
    for copy in sorted(copies, key=lambda c: c.last_synced):
        if total <= budget_bytes:
            break
        if remove_copy(copy, busy):
            total -= copy.disk_bytes
            removed.append(copy)
    return removed


class VolumeCopyCollector:
    """Keeps the node's volume copies within their budget, from the event loop: one
    collection at a time; an exit during one asks for another."""

    def __init__(self, root: Path, budget_bytes: int, busy: Callable[[str], bool]) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        # Whether an app has a replica here: asked from the collecting thread, under a
        # copy's lock.
        self.busy = busy
        self._collection: asyncio.Task[None] | None = None
        self._again = False
        self._collected_at = -VOLUME_COLLECTION_SECONDS  # time.monotonic() of the last

    def collect_soon(self) -> None:
        if self._collection is not None and not self._collection.done():
            self._again = True
            return
        self._collection = asyncio.ensure_future(self._collect())

    async def _collect(self) -> None:
        """Copies of apps that have no replica here go, the least recently synced first."""
        while True:
            pause = self._collected_at + VOLUME_COLLECTION_SECONDS - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)  # exits meanwhile are covered by the walk after it
            self._again = False
            try:
                removed = await asyncio.to_thread(
                    collect_garbage, self.root, self.budget_bytes, self.busy
                )
            except OSError as exc:
                log.warning("could not clean up volume copies in %s: %s", self.root, exc)
                return
            self._collected_at = time.monotonic()
            for copy in removed:
                log.info(
                    "removed this node's copy of volume %s/%s (%.1f MB, unused by its "
                    "replicas here): volume copies were over --volume-cache-gb=%g",
                    copy.app,
                    copy.volume,
                    copy.disk_bytes / 1e6,
                    self.budget_bytes / 1e9,
                )
            if not self._again:
                return
