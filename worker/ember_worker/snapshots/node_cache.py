"""This node's cache of snapshot images: a folder per image under its root, the least
recently used removed past the budget, never one that a restore or a publish reads now.

Beside the images, takes, publishes, fetches and restores work in folders of their own
(`work_dir`), whose names start with a dot: the cache's collection never sees them.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("ember.worker")
WORK_PREFIXES = (".take-", ".publish-", ".fetch-", ".restore-")  # mkdtemp's, under root


def image_name(key: str, image_id: str | None) -> str:
    """The cache folder of one image of `key`. The key is what must match to restore;
    each dump of it is an image of its own. A key dropped and taken again (`ember snapshot
    rm`, a failed restore) gets a new image, which a node holding the old one must not
    mistake for it. Images from before image ids have the key alone."""
    return f"{key}-{image_id}" if image_id else key


class ImageCache:
    """The image folders under `root`, kept within `budget_bytes`."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        # Readers of each image folder now (by name): the collection leaves those alone.
        self.in_use: dict[str, int] = {}
        root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Work folders of takes, publishes, fetches and restores that a killed worker
        left: none of them is in use as a worker starts, and the cache's collection does
        not see them (a 300 MB half-fetched image stayed for good)."""
        for entry in self.root.iterdir():
            if entry.name.startswith(WORK_PREFIXES) and entry.is_dir():
                log.warning("removing %s, left by a worker that did not end cleanly", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def folder(self, key: str, image_id: str | None) -> Path:
        return self.root / image_name(key, image_id)

    def work_dir(self, prefix: str) -> Path:
        """A new work folder; `prefix` is one of WORK_PREFIXES, perhaps with more after."""
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.root))

    def hold(self, name: str) -> None:
        """The image folder `name` is read from now: not collected until `release`."""
        self.in_use[name] = self.in_use.get(name, 0) + 1

    def release(self, name: str) -> None:
        self.in_use[name] -= 1

    def forget(self, key: str, image_id: str | None) -> None:
        """Drop a local image (a restore from it failed: it may be corrupt), unless a
        restore or a publish is reading it now."""
        folder = self.folder(key, image_id)
        if not self.in_use.get(folder.name):
            shutil.rmtree(folder, ignore_errors=True)

    def forget_key(self, key: str) -> list[str]:
        """Drop every local image of `key` (the control plane dropped it) that nothing
        reads now (the rest go with the cache's garbage collection); their folders."""
        removed = []
        for path in self.root.iterdir():
            if path.name != key and not path.name.startswith(f"{key}-"):
                continue
            if not self.in_use.get(path.name):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def cached(self) -> list[tuple[str, str]]:
        """(key, image id) of each complete image in this node's cache."""
        images = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not (path / "images" / "meta.json").exists():
                continue
            key, _, image_id = path.name.partition("-")
            images.append((key, image_id))
        return images

    def has(self, key: str, image_id: str | None) -> bool:
        """Whether the image is in this node's cache."""
        return (self.folder(key, image_id) / "images" / "meta.json").exists()

    def room_for(self, size: int) -> bool:
        """Whether an image of `size` bytes fits in the cache beside what it holds, so that
        fetching it ahead of need would evict nothing."""
        return sum(size for _, size, _ in self._entries()) + size <= self.budget_bytes

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last used, bytes, folder) of each image in the cache."""
        entries = []
        for path in self.root.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            # By inode: a huge-page view of an image hard-links its files (huge_pages.py).
            files = {}
            for f in path.rglob("*"):
                stat = f.lstat()
                if f.is_file() and not f.is_symlink():
                    files[stat.st_ino] = stat.st_size
            entries.append((path.stat().st_mtime, sum(files.values()), path))
        return entries

    def collect_garbage(self) -> list[str]:
        """Remove the least recently used images until the cache fits its budget."""
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, path in sorted(entries):
            if total <= self.budget_bytes:
                break
            if self.in_use.get(path.name):
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed.append(path.name)
        return removed
